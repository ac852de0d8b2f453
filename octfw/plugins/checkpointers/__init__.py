"""Checkpointers (recipe table ``[checkpointer]``): ``local`` and ``gcs``,
both on :mod:`octfw.storage.checkpoints`. One module per checkpointer holds
its config, its code and its registration; both are
:class:`octfw.storage.checkpointer.StoredCheckpointer` over their own folder."""
