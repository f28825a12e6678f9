"""The experiment-tracker runs active in this process, as text for a version's ``meta``.

A snapshot records which tracker run it belongs to (Weights & Biases, MLflow), so that a version found
in ``log`` leads back to the run's curves and a run's page can name its checkpoints. Trackers are found
only if the training script already imported them (``sys.modules``): nothing is imported here, and a
tracker that is not in use costs nothing.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("ckptrepo")


def tracker_meta(tensorboard_dir: str | None = None) -> dict[str, str]:
    """``{"wandb.run_id": ..., "wandb.url": ..., "mlflow.run_id": ..., ...}`` for the runs active now, plus
    ``tensorboard.log_dir`` when given (a TensorBoard writer is not discoverable from outside; the
    framework adapters pass theirs)."""
    out: dict[str, str] = {}
    for find in (_wandb, _mlflow):
        try:
            out.update(find())
        except Exception as err:  # noqa: BLE001 - a tracker's own bug must never fail a snapshot
            log.debug("ckptrepo: could not read the active %s run: %s", find.__name__.strip("_"), err)
    if tensorboard_dir:
        out["tensorboard.log_dir"] = str(tensorboard_dir)
    return out


def without_credentials(uri: Any) -> str | None:
    """``uri`` without a user, password or query (``https://alice:token@host/?key=...`` -> ``https://host/``): a
    header is read by anyone who can list versions and is pushed to every remote, so no secret goes there."""
    if not isinstance(uri, str):
        return None
    from urllib.parse import urlsplit, urlunsplit
    try:
        parts = urlsplit(uri)
    except ValueError:
        return None
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _text(values: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in values.items() if v not in (None, "")}


def _wandb() -> dict[str, str]:
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None:
        return {}
    return _text({"wandb.run_id": getattr(run, "id", None), "wandb.project": getattr(run, "project", None),
                  "wandb.url": getattr(run, "url", None)})


def _mlflow() -> dict[str, str]:
    mlflow = sys.modules.get("mlflow")
    active = getattr(mlflow, "active_run", None) if mlflow is not None else None
    run = active() if callable(active) else None
    if run is None:
        return {}
    info = run.info
    uri = without_credentials(mlflow.get_tracking_uri()) if mlflow is not None else None
    url = None
    if isinstance(uri, str) and uri.startswith(("http://", "https://")):   # a tracking server: its run page
        url = f"{uri.rstrip('/')}/#/experiments/{info.experiment_id}/runs/{info.run_id}"
    return _text({"mlflow.run_id": info.run_id, "mlflow.experiment_id": info.experiment_id,
                  "mlflow.tracking_uri": uri, "mlflow.url": url})
