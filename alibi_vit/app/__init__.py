"""``alibi-vit app``: trainable segmentation in the browser (README.md "Interactive app").

- :mod:`~alibi_vit.app.session`: the session folder (classes, labels, strokes), saved as it changes.
- :mod:`~alibi_vit.app.engine`: features in the background, training, prediction and Save jobs on
  :class:`~alibi_vit.trainable.TrainableSegmenter`, whose model format it writes unchanged.
- :mod:`~alibi_vit.app.server`: the HTTP API (``API.md``) and the page (``static/``).
"""
