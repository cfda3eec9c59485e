"""``alibi-vit app``: trainable segmentation in the browser (docs/app.md).

- :mod:`~alibi_vit.app.session`: the session folder (classes, labels, strokes), saved as it changes.
- :mod:`~alibi_vit.app.imagefiles`: image files checked from their header (pixel cap) and their pixel kind.
- :mod:`~alibi_vit.app.scheduler`: the one worker thread, by priority, coalescing, preemptible.
- :mod:`~alibi_vit.app.engine`: features in the background, training, prediction and Save jobs on
  :class:`~alibi_vit.trainable.TrainableSegmenter`, whose model format it writes unchanged.
- :mod:`~alibi_vit.app.model_store`: the last trained model in the session folder, restored on a restart.
- :mod:`~alibi_vit.app.server`: the HTTP API (``API.md``) and the page (``static/``).
"""
