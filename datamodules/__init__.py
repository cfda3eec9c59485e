"""Lightning DataModules: image folders and COCO for distillation, segmentation datasets for the probes."""
