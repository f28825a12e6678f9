"""Lightning: ``Trainer(plugins=[CkptRepoIO(url)])`` saves every checkpoint as a version of a repository.

``CkptRepoIO`` is a ``CheckpointIO`` plugin. ``save_checkpoint`` takes one asynchronous snapshot through
ckptrepo's snapshotter (it returns once the state is captured, and the bytes are written in the
background), tagged with the file name ``ModelCheckpoint`` chose (with its parent directories where another
checkpoint directory holds that name), and writes a small pointer file at that path before it returns, so
Lightning's own bookkeeping (``-vN`` names, top-k, ``ckpt_path="last"``) works on files as usual. The
second optimizer step after the save of a small state waits for its commit if it is not committed yet, so a
crash loses no checkpoint older than two steps. ``load_checkpoint`` follows a pointer file into this
repository (never another), or takes a revision (``"@20"``, a tag, an id); ``remove_checkpoint`` deletes the
pointer and the tag and prunes the version's data. ``load_from_checkpoint`` builds a ``LightningModule``
from a checkpoint (Lightning's own classmethod reads the file with ``torch.load``, which a pointer is not
for). A fit that loaded nothing and first saves into a new logger folder (no ``ModelCheckpoint(dirpath=)``)
while another holds this repository's last checkpoint is stopped there: ``ckpt_path="last"`` missed it
(decision 049). The mechanics live in ``integrations/_checkpoint_files.py``;
docs/decisions/027-lightning-checkpointio.md and 041-lightning-paths-exist-at-once.md say why it is built
this way.

Lightning is imported only when ``CkptRepoIO`` is first used (``import ckptrepo`` never imports it).
"""
from __future__ import annotations

import glob
import os
import pickle
import re
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable

from ckptrepo.errors import ArgumentError, CkptRepoError, UnsupportedValueError, first_line
from ckptrepo.integrations._checkpoint_files import CheckpointFiles
from ckptrepo.integrations._pointer_files import file_exists, is_remote, path_key, read_pointer

if TYPE_CHECKING:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

    from ckptrepo.saving import SnapshotHandle


def _device(map_location: Any) -> Any:
    """The device a load puts tensors on: a ``map_location`` that is one device; otherwise the CPU (Lightning
    moves the state onto the model's device itself)."""
    import torch
    return map_location if isinstance(map_location, (str, torch.device)) else None


# Lightning's process launchers (ddp_spawn, ddp_fork) hand the final weights from rank 0 to the main process
# through a file of this name in a temporary folder, saved and loaded with the CheckpointIO: it is no checkpoint
# of the run, and as a version it would stay in the repository, tagged, after the folder is gone
_HANDOFF_FILE = ".temp.ckpt"


# a save of a state up to this size is committed by the COMMIT_WITHIN_STEPS-th optimizer step after it: that
# step waits for it if it is not (a small state's write takes milliseconds, so it seldom waits); a larger
# state's write overlaps as many steps as it takes
SMALL_STATE_BYTES = 64 << 20
COMMIT_WITHIN_STEPS = 2


class _StepWatch:
    """Attaches each optimizer that steps while checkpoints are being saved to the snapshotter, so that its
    ``step()`` waits for capture and ``save_checkpoint`` need not: the plugin never sees Lightning's optimizers,
    but a global step pre-hook of torch sees every one (Lightning's ``LightningOptimizer`` steps the inner one).
    Until an optimizer is attached, a save waits for its capture itself. The same hook makes the
    ``COMMIT_WITHIN_STEPS``-th step after the save of a small state wait for its commit."""

    def __init__(self, files: CheckpointFiles) -> None:
        self.files = files
        self._hook: Any = None
        self._snap: Any = None   # the snapshotter the optimizers below are attached to
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._young: list[list[Any]] = []   # [handle, optimizer steps since its save] of small saves in flight

    def start(self) -> None:
        if self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook
            self._hook = register_optimizer_step_pre_hook(self._pre_step)

    def stop(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        with self._lock:
            self._young.clear()

    def attached(self) -> bool:
        return self._snap is self.files.current_snapshotter and len(self._seen) > 0

    def track(self, handle: SnapshotHandle) -> None:
        if handle.stats.bytes <= SMALL_STATE_BYTES and not handle.done():
            with self._lock:
                self._young.append([handle, 0])

    def _pre_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._commit_old_saves()
        snap = self.files.current_snapshotter
        if snap is None:
            return
        if snap is not self._snap:   # a new snapshotter (after teardown): attach again
            self._snap, self._seen = snap, weakref.WeakSet()
        if optimizer not in self._seen:
            snap.attach(optimizer)   # from the next step on, its own pre-hook waits for capture
            self._seen.add(optimizer)
            snap.wait_captured()     # this step: wait here

    def _commit_old_saves(self) -> None:
        with self._lock:
            due = []
            for entry in list(self._young):
                entry[1] += 1
                if entry[0].done():
                    self._young.remove(entry)
                elif entry[1] >= COMMIT_WITHIN_STEPS:
                    due.append(entry[0])
                    self._young.remove(entry)
        for handle in due:
            try:
                handle.result()
            except CkptRepoError:   # the plugin's next call raises it
                pass


def _last_checkpoint_elsewhere(files: CheckpointFiles, path: str) -> str | None:
    """The newest ``last*.ckpt`` pointer into this repository (with this ``tag_prefix``) in another version
    folder of the same logger, when ``path`` is in a logger's ``version_N/checkpoints`` folder: there
    ``ModelCheckpoint`` was given no ``dirpath``, so each run saves into a new folder, and Lightning's
    ``ckpt_path="last"``, which looks only in the callback's own folder (as with its own files), found
    nothing; None otherwise."""
    if is_remote(path):
        return None
    folder = os.path.dirname(os.path.abspath(path))
    run = os.path.dirname(folder)
    if os.path.basename(folder) != "checkpoints" or not re.fullmatch(r"version_\d+", os.path.basename(run)):
        return None
    found: list[tuple[float, str]] = []
    for other in glob.glob(os.path.join(glob.escape(os.path.dirname(run)), "version_*", "checkpoints", "last*.ckpt")):
        if os.path.dirname(os.path.dirname(other)) == run:
            continue
        try:
            pointer = read_pointer(other)
            if pointer is not None and files.names_ours(pointer):
                found.append((os.path.getmtime(other), other))
        except (CkptRepoError, OSError):   # a damaged or vanished file is no checkpoint to resume
            continue
    return max(found)[1] if found else None


class _WrapperQueue:
    """Lightning's ``AsyncCheckpointIO`` calls ``save_checkpoint`` on its own thread, from a queue, but passes
    ``remove_checkpoint`` on at once, on the training thread: a remove can reach the plugin before the save of
    the same path does. Lightning removes only paths it saved, so a path with no file and no save here yet has
    its save still queued: it is marked, and that save is dropped when it comes (saved, then removed, in
    Lightning's order). A remove of a path whose save is under way waits for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._removed: set[str] = set()   # paths removed before their queued save came
        self._arriving: dict[str, threading.Event] = {}   # path -> its save under way in the plugin

    def arrive(self, key: str, queued: bool) -> threading.Event | None:
        """A save of ``key`` begins (``queued``: on a wrapper's thread); None when it is to be dropped."""
        with self._lock:
            if queued and key in self._removed:
                self._removed.discard(key)
                return None
            self._removed.discard(key)
            self._arriving[key] = arrived = threading.Event()
            return arrived

    def leave(self, key: str, arrived: threading.Event) -> None:
        with self._lock:
            if self._arriving.get(key) is arrived:
                del self._arriving[key]
        arrived.set()

    def removed_first(self, key: str, nothing_there: Callable[[], bool]) -> bool:
        """Whether a remove of ``key`` is of a save still queued (``nothing_there()``: no file and no save in
        flight); otherwise waits for a save of it under way."""
        with self._lock:
            arriving = self._arriving.get(key)
            if arriving is None and nothing_there():
                self._removed.add(key)
                return True
        if arriving is not None:
            arriving.wait()
        return False

    def clear(self) -> None:
        with self._lock:
            self._removed.clear()


def _define() -> type[CheckpointIO]:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class CkptRepoIO(CheckpointIO):
        """A Lightning ``CheckpointIO`` over the repository at ``url`` (created on the first save if absent).

        ``tag_prefix`` goes before each tag (``run7/`` keeps runs that share a repository and their file names
        apart); other keywords go to ``repo.snapshotter()`` (``host_memory``, ``max_in_flight``, ...). A
        checkpoint file that is not a ckptrepo pointer (written by Lightning itself) loads and is removed as
        ``TorchCheckpointIO`` would. It pickles as its arguments (``strategy="ddp_spawn"`` sends it to each
        process). Wrapped in ``AsyncCheckpointIO``, each save (on that wrapper's thread) is committed before it
        returns, as that wrapper never passes ``teardown`` on.
        """

        def __init__(self, url: str | os.PathLike[str], tag_prefix: str = "", **snapshotter_options: Any) -> None:
            super().__init__()
            self._arguments: tuple[Any, str, dict[str, Any]] = (url, tag_prefix, snapshotter_options)
            # Lightning saves on global rank 0 alone, under DDP too: that process holds the whole state
            self.files = CheckpointFiles(url, tag_prefix=tag_prefix, **{"single_process": True, **snapshotter_options})
            self._torch_io = TorchCheckpointIO()
            self._steps = _StepWatch(self.files)
            # after teardown nothing waits for a save any more (Lightning's process launchers save the final
            # weights then, and the worker process exits at once): such a save is committed before it returns
            self._torn_down = False
            self._queue = _WrapperQueue()
            self._resumed = self._saved = False   # this fit loaded a checkpoint / saved one already

        def __getstate__(self) -> dict[str, Any]:
            return {"arguments": self._arguments}

        def __setstate__(self, state: dict[str, Any]) -> None:
            url, tag_prefix, options = state["arguments"]
            self.__init__(url, tag_prefix, **options)   # type: ignore[misc]

        @property
        def url(self) -> str:
            return self.files.url

        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
            """One version of ``checkpoint``, tagged with ``path``'s file name (more of the path where another live
            checkpoint holds that name), with its pointer file at ``path``; returns once it is captured."""
            if storage_options is not None:
                raise ArgumentError(f"CkptRepoIO takes no storage_options (got {storage_options!r}); pass the "
                                f"snapshotter's options to CkptRepoIO(...) instead")
            if os.path.basename(os.fspath(path)) == _HANDOFF_FILE:
                self._torch_io.save_checkpoint(checkpoint, path)   # a hand-off between processes, not a checkpoint
                return
            # a save off the main thread comes from a wrapper's queue (AsyncCheckpointIO), which never passes
            # teardown on: it is committed before it returns
            wrapped = threading.current_thread() is not threading.main_thread()
            if not self._saved and not self._resumed:
                self._refuse_a_run_that_missed_its_last_checkpoint(os.fspath(path))
            self._saved = True
            key = path_key(os.fspath(path))
            arrived = self._queue.arrive(key, queued=wrapped)
            if arrived is None:
                return   # Lightning removed it while it was queued
            step = checkpoint.get("global_step")
            if not wrapped:
                self._steps.start()
            try:
                handle = self.files.save(checkpoint, path, step=step if isinstance(step, int) else None,
                                         wait_captured=wrapped or not self._steps.attached())
                if self._torn_down or wrapped:
                    self.files.close()
                else:
                    self._steps.track(handle)
            except UnsupportedValueError as err:
                if "hyper_parameters']" not in str(err):
                    raise
                raise UnsupportedValueError(f"{first_line(err)}; Lightning saves the hyperparameters with each "
                                            f"checkpoint: pass them as plain values (str for a path, the value of "
                                            f"an enum), or leave that one out with "
                                            f"save_hyperparameters(ignore=[...])") from None
            finally:
                self._queue.leave(key, arrived)

        def _refuse_a_run_that_missed_its_last_checkpoint(self, path: str) -> None:
            """A first save, with no checkpoint loaded, into a new logger folder while another holds this
            repository's last checkpoint: ``ckpt_path="last"`` found nothing (without ``dirpath`` each run
            has a folder of its own), and the run would go on from scratch with only a warning."""
            last = _last_checkpoint_elsewhere(self.files, path)
            if last is not None:
                raise CkptRepoError(
                    f"this fit started from scratch, but {last} holds the last checkpoint of this repository: "
                    f"ckpt_path=\"last\" looks only in ModelCheckpoint's folder, and without "
                    f"ModelCheckpoint(dirpath=...) each run gets a new one; give every run the same dirpath, "
                    f"pass ckpt_path={last!r}, or start a separate run with another tag_prefix or repository")

        def load_checkpoint(self, path: Any, map_location: Any | None = None,
                            weights_only: bool | None = None) -> dict[str, Any]:
            """The checkpoint a pointer file at ``path`` names, or the version ``path`` names as a revision; a
            file of Lightning's own format loads as ``TorchCheckpointIO`` loads it. Waits for the saves in flight
            first. ckptrepo never unpickles, whatever ``weights_only`` says. FileNotFoundError when ``path``
            names no checkpoint."""
            state = self.files.load(path, device=_device(map_location))
            self._resumed = True
            if state is None:
                try:
                    return self._torch_io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
                except (pickle.UnpicklingError, EOFError, RuntimeError) as err:   # torch's run over many lines
                    raise CkptRepoError(f"checkpoint file {os.fspath(path)} is no ckptrepo pointer, and torch.load "
                                        f"cannot read it ({type(err).__name__}: {first_line(err)[:200]}); pass a "
                                        f"checkpoint this plugin or Lightning saved") from None
            if not isinstance(state, dict):
                raise CkptRepoError(f"{os.fspath(path)} names a version that holds a {type(state).__name__}, not a "
                                    f"Lightning checkpoint (a dict); pick one Lightning saved")
            return state

        def load_from_checkpoint(self, cls: type[Any], path: Any, map_location: Any | None = None,
                                 **kwargs: Any) -> Any:
            """``cls.load_from_checkpoint(path, ...)`` for a checkpoint this plugin saved (or any ``path`` its
            ``load_checkpoint`` takes): Lightning's classmethod reads the file with ``torch.load`` itself, and a
            pointer file holds no tensors. ``kwargs`` go to it (``strict``, hyperparameters to override)."""
            import io

            import torch
            buffer = io.BytesIO()
            torch.save(self.load_checkpoint(path, map_location=map_location), buffer)
            buffer.seek(0)
            return cls.load_from_checkpoint(buffer, map_location=map_location, **kwargs)

        def remove_checkpoint(self, path: Any) -> None:
            """Delete the checkpoint file; the version's tag goes now, its data once nothing else names it (see
            ``_WrapperQueue`` for a path whose save a wrapper still queues)."""
            text = os.fspath(path)
            if self._queue.removed_first(path_key(text),
                                         lambda: not file_exists(text) and not self.files.in_flight(text)):
                return
            self.files.remove(text)

        def teardown(self) -> None:
            """At the end of ``fit``: every save is committed and its pointer durable (failures raised here), and
            no thread of the plugin's is left."""
            self._steps.stop()
            self._torn_down = True
            self._resumed = self._saved = False
            self._queue.clear()
            self.files.close()
            from ckptrepo.storage import release_reader_threads
            release_reader_threads()   # a resume's loads started them; Lightning expects no thread left

    CkptRepoIO.__module__ = __name__
    CkptRepoIO.__qualname__ = "CkptRepoIO"
    return CkptRepoIO


def __getattr__(name: str) -> Any:
    """``CkptRepoIO`` is defined on first use: its base class is Lightning's, imported only then."""
    if name == "CkptRepoIO":
        cls = _define()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

