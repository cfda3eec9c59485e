"""LightningModules: distillation of DINOv2 into ALiBi students, segmentation linear probes, RASA
post-training, and the ``lightning`` command (``cli.py``); the evaluations they log live in ``alibi_vit.analysis``.
"""
