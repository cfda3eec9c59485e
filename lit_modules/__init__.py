"""LightningModules: distillation of DINOv2 into ALiBi students, segmentation linear probes."""
