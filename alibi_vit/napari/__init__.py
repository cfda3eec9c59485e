"""The napari plugin: open mosaics and volumes lazily, scribble, train, segment (docs/napari.md).

An npe2 plugin (manifest ``napari.yaml`` beside this file, found through the ``napari.manifest``
entry point): :mod:`.reader` opens TIFF/BigTIFF/OME-TIFF and zarr/OME-Zarr through
:mod:`alibi_vit.chunked` as multiscale layers, :mod:`.widget` is the dock widget (Train, live
retraining, Predict, Save/Load model), :mod:`.sample_data` the labelled micrographs shipped with the
package. The segmenter comes from :mod:`.engine`, which builds it from ``alibi-vit segment train``'s
own options, so napari, the app and the command share one engine and one model folder format.

Importing this package imports neither napari nor Qt; :mod:`.reader` and :mod:`.engine` need neither.
"""
