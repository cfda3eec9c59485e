"""Lightning DataModules: image folders and COCO for distillation, segmentation datasets for the probes."""


class DatasetLayoutError(FileNotFoundError):
    """A dataset root that does not have the documented layout; the message shows the layout expected.

    The ``lightning`` command prints it as an error message (no traceback), whichever datamodule raised it.
    """
