"""The Hugging Face Hub: an encoder's folder uploaded to a repository, and a repository's
folder downloaded (through ``huggingface_hub``, the ``hub`` extra, and its cache).
:class:`~octfw.exports.pretrained.PretrainedEncoder` calls these from ``push_to_hub`` and
``from_pretrained``; the folder is the ``safetensors`` export's (:mod:`octfw.exports.formats`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from octfw.display.errors import UserError
from octfw.exports.formats import CONFIG_FILE, WEIGHTS_FILE

if TYPE_CHECKING:  # typing only: the encoder calls upload() with itself
    from octfw.exports.pretrained import PretrainedEncoder

__all__ = ["upload", "download"]


def upload(encoder: PretrainedEncoder, repo_id: str, *, private: bool | None, token: str | None,
           revision: str | None, commit_message: str, api: Any) -> Any:
    """``encoder.save_pretrained`` into a temporary folder, uploaded to ``repo_id`` (created if
    missing) with ``api`` (``huggingface_hub.HfApi(token=token)`` when None); returns what
    ``upload_folder`` returns. A failed upload raises UserError naming the repository."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:
        raise UserError(f"push_to_hub: {repo_id}: needs the huggingface_hub package: "
                        "pip install 'octfw[hub]'") from None
    api = HfApi(token=token) if api is None else api
    with tempfile.TemporaryDirectory(prefix="octfw-push-") as temporary:
        folder = encoder.save_pretrained(Path(temporary) / "encoder")
        try:
            api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
            return api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                                     revision=revision, commit_message=commit_message)
        except (HfHubHTTPError, OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise UserError(f"push_to_hub: {repo_id}: the upload failed ({type(exc).__name__}: {first})") from None


def download(repo_id: str, revision: str | None, options: Mapping[str, Any]) -> str:
    """The local snapshot folder of a Hub repository (from the cache when it is there)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise UserError(f"from_pretrained: {repo_id}: no such folder; loading from the Hugging Face Hub needs "
                        "the huggingface_hub package: pip install 'octfw[hub]'") from None
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE, "README.md"],
                                 library_name="octfw", **options)
    except (HfHubHTTPError, LocalEntryNotFoundError, ValueError, OSError) as exc:
        raise UserError(f"from_pretrained: {repo_id}: no such folder, and not found on the Hugging Face Hub "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
