"""Evaluations of frozen backbones: the positional probe, channel ranking, feature maps,
OverClustering and RASA plane removal.

Each works on patch features and arrays; none trains a network or reads a dataset layout
(the LightningModules in ``lit_modules`` and the commands in :mod:`alibi_vit.cli` do).
"""
