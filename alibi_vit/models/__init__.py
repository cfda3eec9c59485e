"""The models: ALiBi/NoPE conversions of DINOv2 and DINOv3, the baselines, their timm registrations,
and building a backbone by name with its weights (checkpoint reading and key translation).

A new model goes here: its conversion in its own module, its name in ``names.py``, its timm
registration in ``registry.py``. The public names are re-exported by :mod:`alibi_vit`.
"""
