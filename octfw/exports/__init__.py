"""The encoder as it leaves octfw: exported from a run, written and read back in each format,
loaded in Python, embedding volumes, to and from the Hugging Face Hub.

One module per concern:

- :mod:`~octfw.exports.checkpoint`: the checkpoint a run folder or file names (a run's:
  :func:`octfw.runs.checkpoint.run_checkpoint`), its recorded recipe, the model rebuilt, its target
  encoder and what an export records of it;
- :mod:`~octfw.exports.export`: ``octfw export``: where an export may be written, then writing it;
- :mod:`~octfw.exports.formats`: what every format records (``encoder_info``) and its files' names;
- :mod:`~octfw.exports.writing`: one writer per format; :mod:`~octfw.exports.card` the model
  card and :mod:`~octfw.exports.monai_bundle` a MONAI bundle's configs, which it writes;
- :mod:`~octfw.exports.reading`: each format read back;
- :mod:`~octfw.exports.pretrained`: :class:`~octfw.exports.pretrained.PretrainedEncoder` and
  :func:`~octfw.exports.pretrained.load_encoder` (``octfw.load_encoder``);
- :mod:`~octfw.exports.hub`: upload to and download from the Hugging Face Hub;
- :mod:`~octfw.exports.volumes`: volumes as users have them, opened for embedding;
- :mod:`~octfw.exports.embed_csv`: ``octfw embed``, one embedding per volume in a CSV.

This package's ``__init__`` imports nothing: the export command's ``--help`` takes
``EXPORT_FORMATS`` from :mod:`~octfw.exports.formats` without importing torch.
(Not ``octfw.export``: that is the function :func:`octfw.api.export`.)
"""
