"""Lightning through ``CkptRepoIO``: fit, checkpoint into a repository, resume bit for bit, top-k bookkeeping.

A tiny random-init model on synthetic data on the CPU; nothing downloaded. Resuming from a checkpoint must
give the losses an uninterrupted run gives, step for step and bit for bit.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import ckptrepo  # noqa: E402
from ckptrepo import faults  # noqa: E402
from ckptrepo.errors import RevisionError, SnapshotFailedError, StorageError, UnsupportedValueError  # noqa: E402
from ckptrepo.integrations._checkpoint_files import CheckpointFiles, read_pointer  # noqa: E402
from ckptrepo.integrations.lightning import CkptRepoIO  # noqa: E402

EPOCHS = 4
BATCHES = 8   # per epoch


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.02) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, _i: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, _i: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)}


class Losses(pl.Callback):
    """Every training step's loss, by the global step its optimizer step reached."""

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_train_batch_end(self, trainer: Any, _m: Any, outputs: Any, _b: Any, _i: int) -> None:
        self.by_step[trainer.global_step] = float(outputs["loss"])


def loaders() -> tuple[Any, Any]:
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCHES * 8, 8, generator=g), torch.randn(BATCHES * 8, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8), DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8)


def fit(epochs: int, callbacks: list[Any], plugins: list[Any] | None = None, ckpt_path: Any = None,
        checkpointing: bool = True) -> tuple[Losses, Any]:
    pl.seed_everything(7, verbose=False)
    losses = Losses()
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", deterministic=True, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=checkpointing,
                         callbacks=[losses, *callbacks], plugins=plugins or [])
    trainer.fit(Tiny(), *loaders(), ckpt_path=ckpt_path)
    return losses, trainer


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",   # Lightning's own
                                        "ignore::FutureWarning")


@pytest.fixture(autouse=True)
def _no_faults() -> Iterator[None]:
    yield
    faults.clear()


@pytest.fixture(scope="module")
def uninterrupted() -> dict[int, float]:
    losses, _ = fit(EPOCHS + 1, [], checkpointing=False)
    return losses.by_step


def checkpoint_callback(dirpath: Path, **kwargs: Any) -> Any:
    return pl.callbacks.ModelCheckpoint(dirpath=dirpath, **kwargs)


def after(losses: dict[int, float], step: int) -> dict[int, float]:
    """The losses of the steps taken after global step ``step`` (a resume from a checkpoint saved there)."""
    return {s: v for s, v in losses.items() if s > step}


def test_fit_with_top_k_then_resume_matches_uninterrupted(tmp_path: Path, uninterrupted: dict[int, float]) -> None:
    url, ckdir = tmp_path / "repo", tmp_path / "ck"
    ck = checkpoint_callback(ckdir, save_top_k=2, monitor="val_loss", save_last=True)
    losses, _ = fit(EPOCHS, [ck], [CkptRepoIO(url)])
    assert losses.by_step == {s: v for s, v in uninterrupted.items() if s <= EPOCHS * BATCHES}   # saving: no change

    # (b) top-k: the two best and last.ckpt are files, tags and loadable versions; the others are pruned
    files = sorted(os.listdir(ckdir))
    assert len(files) == 3 and "last.ckpt" in files, files
    kept = {name: read_pointer(ckdir / name) for name in files}
    repo = ckptrepo.open(url)
    assert set(repo.tags()) == set(files)   # the file names as they are
    for name, pointer in kept.items():
        assert pointer is not None and repo.tags()[name] == pointer.version
        assert repo.load(pointer.version)["global_step"] == pointer.step
    gone = [v for v in repo.log() if v.id not in {p.version for p in kept.values() if p is not None}]
    assert len(gone) == 2 * EPOCHS - 3   # one top-k file and one last.ckpt per epoch
    for v in gone:
        assert v.pruned
        with pytest.raises(RevisionError, match="pruned"):
            repo.load(v.id)

    # (a) a fresh Trainer resumes from the earliest kept checkpoint (mid-run) and trains as if never stopped
    earliest = min((p for n, p in kept.items() if n != "last.ckpt"), key=lambda p: p.step or 0)
    assert earliest.step is not None and earliest.step < EPOCHS * BATCHES
    path = next(ckdir / n for n, p in kept.items() if p == earliest)
    resumed, trainer = fit(EPOCHS + 1, [checkpoint_callback(tmp_path / "ck2")], [CkptRepoIO(url)], ckpt_path=path)
    assert resumed.by_step == after(uninterrupted, earliest.step)
    assert trainer.global_step == (EPOCHS + 1) * BATCHES

    # (c) ckpt_path="last": the newest last.ckpt (here the first run's: the second wrote its own elsewhere)
    again, _ = fit(EPOCHS + 1, [checkpoint_callback(ckdir, save_last=True)], [CkptRepoIO(url)], ckpt_path="last")
    assert again.by_step == after(uninterrupted, EPOCHS * BATCHES)


def test_mid_epoch_resume_as_lightnings_own_files(tmp_path: Path) -> None:
    """Mid-epoch: Lightning restarts the interrupted epoch's data from its start unless the loader is stateful,
    so no run matches an uninterrupted one there; a resume from our version must match a resume from the file
    Lightning's own TorchCheckpointIO wrote at the same step, bit for bit. Also: revisions as ckpt_path."""
    url = tmp_path / "repo"
    fit(2, [checkpoint_callback(tmp_path / "own", every_n_train_steps=5, save_top_k=-1)])
    fit(2, [checkpoint_callback(tmp_path / "ck", every_n_train_steps=5, save_top_k=-1)], [CkptRepoIO(url)])
    theirs, _ = fit(EPOCHS, [], ckpt_path=tmp_path / "own" / "epoch=1-step=10.ckpt", checkpointing=False)
    assert min(theirs.by_step) == 11 and len(theirs.by_step) > BATCHES
    ours, _ = fit(EPOCHS, [], [CkptRepoIO(url)], ckpt_path="@10", checkpointing=False)   # a revision
    assert ours.by_step == theirs.by_step
    # the file name ModelCheckpoint chose, once its file is gone: its tag
    (tmp_path / "ck" / "epoch=1-step=10.ckpt").unlink()
    ours, _ = fit(EPOCHS, [], [CkptRepoIO(url)], ckpt_path="epoch=1-step=10.ckpt", checkpointing=False)
    assert ours.by_step == theirs.by_step


def test_importing_the_plugin_module_imports_no_lightning() -> None:
    import subprocess
    import sys
    code = ("import sys, ckptrepo, ckptrepo.integrations.lightning, ckptrepo.cli.main; "
            "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules)")
    root = str(Path(ckptrepo.__file__).parent.parent)
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": root})


def test_pointer_names_the_pending_version_once_save_returns(tmp_path: Path) -> None:
    """As with Lightning's own files, the path exists when the save returns (ModelCheckpoint picks its ``-vN``
    names by that); until its version is committed a load waits for it, and a failed save puts back what the
    path held before."""
    files = CheckpointFiles(tmp_path / "repo")
    path = tmp_path / "ck" / "a.ckpt"
    held, release = threading.Event(), threading.Event()

    def hold(_name: str) -> None:
        held.set()
        release.wait(10)
    faults.set_hook("after_manifest", hold)
    handle = files.save({"w": torch.ones(4), "global_step": 3}, path, step=3)
    doc = json.loads(path.read_text())   # at once: the manifest is not even written yet
    assert doc["kind"] == "ckptrepo-checkpoint" and doc["version"] == handle.id and doc["tag"] == "a.ckpt"
    assert doc["step"] == 3 and "previous" not in doc
    assert held.wait(10)
    loaded: list[Any] = []
    loader = threading.Thread(target=lambda: loaded.append(files.load(path)))
    loader.start()
    loader.join(0.3)
    assert loader.is_alive() and not loaded   # waits for the commit
    release.set()
    loader.join(10)
    assert torch.equal(loaded[0]["w"], torch.ones(4))

    # a remove of a path whose save is in flight waits for its commit, then deletes pointer and tag; the
    # version, the branch tip until the next commit, is pruned by that commit
    held.clear()
    release.clear()
    files.save({"w": torch.full((4,), 2.0)}, path, step=4)
    assert held.wait(10)
    remover = threading.Thread(target=files.remove, args=(path,))
    remover.start()
    remover.join(0.3)
    assert remover.is_alive()
    release.set()
    remover.join(10)
    assert not path.exists() and "a.ckpt" not in files.repo.tags()
    tip = files.repo.resolve("HEAD")
    faults.clear()
    files.save({"w": torch.zeros(4)}, tmp_path / "ck" / "c.ckpt", step=5)
    files.wait()
    assert files.repo.version(tip).pruned

    # a failed save: a new path's pointer goes, an overwritten path gets its committed pointer back
    before = (tmp_path / "ck" / "c.ckpt").read_bytes()

    def fail(_name: str) -> None:
        raise OSError("disk on fire")
    faults.set_hook("after_data", fail)
    files.save({"w": torch.zeros(4)}, tmp_path / "ck" / "b.ckpt")
    with pytest.raises(SnapshotFailedError, match="disk on fire"):
        files.wait()
    assert not (tmp_path / "ck" / "b.ckpt").exists()
    files.save({"w": torch.ones(4)}, tmp_path / "ck" / "c.ckpt", step=6)
    with pytest.raises(SnapshotFailedError, match="disk on fire"):
        files.wait()
    assert (tmp_path / "ck" / "c.ckpt").read_bytes() == before
    faults.clear()
    assert torch.equal(files.load(tmp_path / "ck" / "c.ckpt")["w"], torch.zeros(4))
    files.close()


def test_a_save_whose_pointer_cannot_be_written_leaves_the_one_in_flight_in_charge(tmp_path: Path) -> None:
    """c.ckpt committed (P), saved again (A, in flight), then once more where the pointer cannot be written
    (B): B's error says so, and when A fails the path gets P back, as if B had never been asked for."""
    files = CheckpointFiles(tmp_path / "repo")
    path = tmp_path / "ck" / "c.ckpt"
    files.save({"w": torch.zeros(4)}, path, step=1)
    files.wait()
    before = path.read_bytes()
    held, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def hold_then_fail(name: str) -> None:
        calls.append(name)
        if len(calls) == 1:   # A: held until B has been tried, then its commit fails
            held.set()
            release.wait(10)
            raise OSError("disk on fire")
    faults.set_hook("after_data", hold_then_fail)
    files.save({"w": torch.ones(4)}, path, step=2)
    assert held.wait(10)
    # this thread's next pointer write finds a folder where its temporary file goes
    blocker = Path(f"{path}.{os.getpid()}.{threading.get_ident()}.tmp")
    blocker.mkdir()
    with pytest.raises(StorageError, match="cannot write checkpoint file"):
        files.save({"w": torch.full((4,), 2.0)}, path, step=3, wait_captured=False)
    blocker.rmdir()
    release.set()
    with pytest.raises(SnapshotFailedError, match="disk on fire"):
        files.wait()
    faults.clear()
    assert path.read_bytes() == before
    files.close()


def test_saves_of_one_path_in_flight_release_each_version_once(tmp_path: Path) -> None:
    """last.ckpt saved again while its previous save is in flight: each commit releases the version before
    it, the newest stays, and no version is left behind untagged and unpruned."""
    files = CheckpointFiles(tmp_path / "repo")
    path = tmp_path / "last.ckpt"
    ids = [files.save({"w": torch.full((4,), float(i))}, path, step=i).id for i in range(4)]
    files.save({"w": torch.zeros(1)}, tmp_path / "other.ckpt", step=9)   # moves the branch past the last
    files.wait()
    repo = files.repo
    assert read_pointer(path).version == ids[-1] and repo.tags()["last.ckpt"] == ids[-1]   # type: ignore[union-attr]
    assert [repo.version(v).pruned for v in ids] == [True, True, True, False]
    assert torch.equal(files.load(path)["w"], torch.full((4,), 3.0))
    files.close()


_CRASH = """
import os, signal, sys, torch
from ckptrepo import faults
from ckptrepo.integrations._checkpoint_files import CheckpointFiles
files = CheckpointFiles(sys.argv[1])
files.save({"w": torch.ones(4)}, sys.argv[2] + "/last.ckpt", step=1)
files.wait()
faults.set_hook("after_data", lambda _name: os.kill(os.getpid(), signal.SIGKILL))
files.save({"w": torch.full((4,), 2.0)}, sys.argv[2] + "/last.ckpt", step=2)
files.save({"w": torch.full((4,), 3.0)}, sys.argv[2] + "/new.ckpt", step=3)
files.wait()
"""


def test_a_crash_before_the_commit_leaves_no_pointer_to_nothing(tmp_path: Path) -> None:
    """Killed between a save and its commit: the overwritten path loads the version it held before (as a file
    a crash interrupted keeps its old content); a new path says its version was never committed, a
    FileNotFoundError as Lightning expects of a missing checkpoint; removing either prunes nothing else."""
    import subprocess
    import sys
    url, ck = tmp_path / "repo", tmp_path / "ck"
    done = subprocess.run([sys.executable, "-c", _CRASH, str(url), str(ck)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    last, new = read_pointer(ck / "last.ckpt"), read_pointer(ck / "new.ckpt")
    assert last is not None and new is not None and last.previous is not None and new.previous is None
    repo = ckptrepo.open(url)
    assert [v.id for v in repo.log()] == [last.previous]   # neither save was committed
    io = CkptRepoIO(url)
    assert torch.equal(io.load_checkpoint(ck / "last.ckpt")["w"], torch.ones(4))
    with pytest.raises(FileNotFoundError, match="never committed"):
        io.load_checkpoint(ck / "new.ckpt")
    io.remove_checkpoint(ck / "new.ckpt")
    assert not (ck / "new.ckpt").exists() and repo.tags() == {"last.ckpt": last.previous}
    # a save after the crash replaces the version the path held, which goes as an overwritten one does
    io.save_checkpoint({"w": torch.full((4,), 4.0)}, ck / "last.ckpt")
    io.teardown()
    pointer = read_pointer(ck / "last.ckpt")
    assert pointer is not None and pointer.previous == last.previous and repo.version(last.previous).pruned
    assert torch.equal(io.load_checkpoint(ck / "last.ckpt")["w"], torch.full((4,), 4.0))
    io.teardown()


def test_two_directories_saving_one_file_name_keep_a_tag_each(tmp_path: Path) -> None:
    # two ModelCheckpoints (periodic, best) with Lightning's default file name: the second save must not take
    # the first one's tag, or gc prunes that version while its pointer still names it
    url = tmp_path / "repo"
    files = CheckpointFiles(url)
    a, b = tmp_path / "periodic" / "epoch=0-step=10.ckpt", tmp_path / "best" / "epoch=0-step=10.ckpt"
    files.save({"w": torch.ones(4)}, a, step=10)
    files.save({"w": torch.full((4,), 2.0)}, b, step=10)   # both in flight: the first save holds the name
    files.save({"w": torch.full((4,), 3.0)}, tmp_path / "periodic" / "epoch=1-step=20.ckpt", step=20)
    files.wait()
    va, vb = read_pointer(a).version, read_pointer(b).version   # type: ignore[union-attr]
    repo = ckptrepo.open(url)
    tags = repo.tags()
    assert (tags["epoch=0-step=10.ckpt"], tags["best/epoch=0-step=10.ckpt"]) == (va, vb)
    assert read_pointer(b).tag == "best/epoch=0-step=10.ckpt"   # type: ignore[union-attr]
    repo.gc(keep_last=1, grace_period_s=0)
    assert torch.equal(files.load(a)["w"], torch.ones(4)) and torch.equal(files.load(b)["w"], torch.full((4,), 2.0))
    # a file name loads by its tag, the most specific spelling first
    assert files.resolve("epoch=0-step=10.ckpt")[1] == va   # type: ignore[index]
    assert files.resolve("best/epoch=0-step=10.ckpt")[1] == vb   # type: ignore[index]
    # a save to the same path moves that path's own tag (as last.ckpt's)
    files.save({"w": torch.full((4,), 4.0)}, b, step=11)
    files.wait()
    vb2 = read_pointer(b).version   # type: ignore[union-attr]
    assert repo.tags()["best/epoch=0-step=10.ckpt"] == vb2 != vb and repo.tags()["epoch=0-step=10.ckpt"] == va
    files.close()

    # another process (no memory of the saves) sees whose tag it is from the version's path and the pointer
    other = CheckpointFiles(url)
    c = tmp_path / "third" / "epoch=0-step=10.ckpt"
    other.save({"w": torch.full((4,), 5.0)}, c, step=10)
    other.wait()
    tags = repo.tags()
    assert tags["third/epoch=0-step=10.ckpt"] == read_pointer(c).version   # type: ignore[union-attr]
    assert (tags["epoch=0-step=10.ckpt"], tags["best/epoch=0-step=10.ckpt"]) == (va, vb2)
    # removing a checkpoint removes its own tag only; its name is then free for a save elsewhere
    other.remove(b)
    tags = repo.tags()
    assert "best/epoch=0-step=10.ckpt" not in tags and tags["epoch=0-step=10.ckpt"] == va
    other.remove(a)
    other.save({"w": torch.full((4,), 6.0)}, c, step=12)
    other.wait()
    tags = repo.tags()
    assert tags["epoch=0-step=10.ckpt"] == read_pointer(c).version   # type: ignore[union-attr]
    assert "third/epoch=0-step=10.ckpt" not in tags   # the path's old tag went with its old version
    other.close()


def test_a_missing_checkpoint_is_a_file_not_found_error(tmp_path: Path) -> None:
    """What Lightning's own code catches: before the first save (no repository yet) and after it."""
    io = CkptRepoIO(tmp_path / "repo")
    for where in (tmp_path / "nothing.ckpt", "@3", "last.ckpt"):
        with pytest.raises(FileNotFoundError, match="no checkpoint has been saved"):
            io.load_checkpoint(where)
    assert not (tmp_path / "repo").exists()   # a load creates no repository
    io.save_checkpoint({"global_step": 1}, tmp_path / "a.ckpt")
    for where in (tmp_path / "nothing.ckpt", "@3", "last.ckpt"):
        with pytest.raises(FileNotFoundError, match=r"no checkpoint file.*@STEP"):
            io.load_checkpoint(where)
    io.teardown()


def test_load_right_after_save_and_lightning_files(tmp_path: Path) -> None:
    io = CkptRepoIO(tmp_path / "repo")
    io.save_checkpoint({"global_step": 4, "state_dict": {"w": torch.arange(6.0)}}, tmp_path / "x.ckpt")
    loaded = io.load_checkpoint(tmp_path / "x.ckpt")   # waits for the save in flight
    assert loaded["global_step"] == 4 and torch.equal(loaded["state_dict"]["w"], torch.arange(6.0))
    # a checkpoint Lightning wrote itself loads and is removed as TorchCheckpointIO would
    torch.save({"global_step": 1}, tmp_path / "own.ckpt")
    assert io.load_checkpoint(tmp_path / "own.ckpt")["global_step"] == 1
    io.remove_checkpoint(tmp_path / "own.ckpt")
    assert not (tmp_path / "own.ckpt").exists()
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):   # as TorchCheckpointIO raises
        io.load_checkpoint(tmp_path / "nothing.ckpt")
    # hyperparameters are saved too, never pickled: a value the skeleton cannot hold is named, with what to do
    with pytest.raises(UnsupportedValueError, match=r"hyper_parameters.*save_hyperparameters\(ignore"):
        io.save_checkpoint({"hyper_parameters": {"root": tmp_path}}, tmp_path / "h.ckpt")
    # save_last="link": removing a link (or a copy) of a checkpoint's pointer leaves that checkpoint alone
    os.symlink(tmp_path / "x.ckpt", tmp_path / "last.ckpt")
    io.remove_checkpoint(tmp_path / "last.ckpt")
    (tmp_path / "copy.ckpt").write_bytes((tmp_path / "x.ckpt").read_bytes())
    io.remove_checkpoint(tmp_path / "copy.ckpt")
    assert "x.ckpt" in ckptrepo.open(tmp_path / "repo").tags()
    assert io.load_checkpoint(tmp_path / "x.ckpt")["global_step"] == 4
    io.teardown()


def test_save_returns_before_capture_once_the_optimizer_is_attached(tmp_path: Path) -> None:
    """After an optimizer has stepped under the plugin, a save returns before its capture, and that optimizer's
    next step waits for it: the version holds the state of the save, not the one after the step."""
    import time
    io = CkptRepoIO(tmp_path / "repo")
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def train_step() -> None:
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
    io.save_checkpoint({"state_dict": model.state_dict(), "global_step": 0}, tmp_path / "a.ckpt")
    train_step()   # the plugin attaches the optimizer here
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def slow(_name: str) -> None:
        time.sleep(1.0)
    faults.set_hook("before_capture", slow)
    t0 = time.perf_counter()
    io.save_checkpoint({"state_dict": model.state_dict(), "global_step": 1}, tmp_path / "b.ckpt")
    assert time.perf_counter() - t0 < 0.7   # did not wait for the (slowed) capture
    train_step()   # waits for it
    faults.clear()
    saved = io.load_checkpoint(tmp_path / "b.ckpt")["state_dict"]
    assert all(torch.equal(saved[k], before[k]) for k in before)
    assert not torch.equal(model.weight, before["weight"])
    io.teardown()


def test_a_repeated_file_name_takes_a_new_version_suffix_as_with_lightnings_files(tmp_path: Path) -> None:
    """``filename="{epoch}"`` with four validations an epoch: ModelCheckpoint names the second save of an epoch
    ``epoch=0-v1.ckpt`` because the first one's file exists, and keeps every checkpoint (save_top_k=-1)."""
    def run(name: str, plugins: list[Any]) -> list[str]:
        ck = checkpoint_callback(tmp_path / name, filename="{epoch}", save_top_k=-1, monitor="step", mode="max")
        pl.seed_everything(7, verbose=False)
        trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, val_check_interval=0.25, callbacks=[ck], plugins=plugins)
        trainer.fit(Tiny(), *loaders())
        return sorted(os.listdir(tmp_path / name))
    theirs = run("own", [])
    ours = run("ck", [CkptRepoIO(tmp_path / "repo")])
    assert len(theirs) == 8 and ours == theirs
    repo = ckptrepo.open(tmp_path / "repo")
    assert sorted(repo.tags()) == ours and len(repo.log()) == 8
    steps = sorted(read_pointer(tmp_path / "ck" / n).step for n in ours)   # type: ignore[union-attr,type-var]
    assert steps == [2, 4, 6, 8, 10, 12, 14, 16]
    assert not any(v.pruned for v in repo.log())


def test_killed_a_few_steps_after_a_save_the_newest_checkpoint_loads(tmp_path: Path) -> None:
    """SIGKILL 4 optimizer steps after a save (tests/support/lightning_ddp_run.py, ``kill``): nothing is flushed or
    closed, and the newest checkpoint ModelCheckpoint wrote must load, with the step it was saved at, as
    Lightning's own torch.save file would."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    url, ck = tmp_path / "repo", tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    script = root / "tests" / "support" / "lightning_ddp_run.py"
    done = subprocess.run([sys.executable, str(script), "kill", str(url), str(ck), str(tmp_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-3000:]
    names = sorted(os.listdir(ck))
    assert names == ["epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt", "epoch=1-step=15.ckpt"], names
    io = CkptRepoIO(url)
    for name, step in (("epoch=1-step=15.ckpt", 15), ("epoch=1-step=10.ckpt", 10)):
        state = io.load_checkpoint(ck / name)
        assert state["global_step"] == step and set(state["state_dict"]) == {"net.0.weight", "net.0.bias",
                                                                            "net.2.weight", "net.2.bias"}
    assert [v.step for v in ckptrepo.open(url).log()] == [15, 10, 5]
    io.teardown()


@pytest.fixture
def ckptrepo_threads() -> Callable[[], list[str]]:
    """The threads of ckptrepo's alive now that were not before the test (another test's snapshotter is not
    this one's), the process's reader pool included (a resume's load starts it; teardown ends it)."""
    before = set(threading.enumerate())
    return lambda: [t.name for t in threading.enumerate() if t.name.startswith("ckptrepo") and t not in before]


def test_load_from_checkpoint_builds_the_module(tmp_path: Path) -> None:
    """Lightning's ``Model.load_from_checkpoint(path)`` reads the file with torch.load, and a pointer holds no
    tensors; ``io.load_from_checkpoint(Model, path)`` builds the module, hyperparameters and weights."""
    ck = checkpoint_callback(tmp_path / "ck", save_last=True)
    _, trainer = fit(1, [ck], [CkptRepoIO(tmp_path / "repo")])
    io = CkptRepoIO(tmp_path / "repo")
    model = io.load_from_checkpoint(Tiny, tmp_path / "ck" / "last.ckpt", lr=0.5)   # an override, as Lightning's
    trained = trainer.lightning_module.state_dict()
    assert set(model.state_dict()) == set(trained)
    assert all(torch.equal(model.state_dict()[k], trained[k]) for k in trained)
    assert model.hparams.lr == 0.5 and isinstance(model, Tiny)
    assert Tiny.load_from_checkpoint is not None   # the classmethod itself still reads files Lightning wrote
    io.teardown()


def test_the_plugin_pickles_for_process_launchers(tmp_path: Path, ckptrepo_threads) -> None:
    """``strategy="ddp_spawn"`` pickles the plugin into each process: it pickles as its arguments, also with
    a save in flight and its threads running, and the copy saves into the same repository."""
    import pickle
    io = CkptRepoIO(tmp_path / "repo", tag_prefix="run/", host_memory="64MiB")
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, tmp_path / "a.ckpt")
    copy = pickle.loads(pickle.dumps(io))
    assert copy.url == io.url and copy.files.tag_prefix == "run/" and copy.files.current_snapshotter is None
    io.teardown()   # one writer at a time on the branch, as a launcher's processes save one after the other
    copy.save_checkpoint({"global_step": 2, "w": torch.zeros(3)}, tmp_path / "b.ckpt")
    copy.teardown()
    assert sorted(ckptrepo.open(tmp_path / "repo").tags()) == ["run/a.ckpt", "run/b.ckpt"]
    assert not ckptrepo_threads()


def test_async_checkpoint_io_keeps_lightnings_top_k_and_leaves_no_thread(tmp_path: Path,
                                                                          ckptrepo_threads) -> None:
    """``AsyncCheckpointIO(CkptRepoIO(...))``: Lightning removes a checkpoint whose save still waits in the
    wrapper's queue; that save, when it comes, must not bring its file, tag and data back. The wrapper never
    passes ``teardown`` on, so each save is committed on the wrapper's thread and no thread is left."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    def slow(_name: str) -> None:   # every save takes a while: the next ones queue up behind it
        import time
        time.sleep(0.05)
    faults.set_hook("before_capture", slow)
    ck = checkpoint_callback(tmp_path / "ck", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max")
    fit(1, [ck], [AsyncCheckpointIO(CkptRepoIO(tmp_path / "repo"))])
    faults.clear()
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == sorted(os.path.basename(p) for p in ck.best_k_models) and len(names) == 2, names
    repo = ckptrepo.open(tmp_path / "repo")
    assert sorted(repo.tags()) == names
    kept = {read_pointer(tmp_path / "ck" / n).version for n in names}   # type: ignore[union-attr]
    assert all(v.pruned for v in repo.log() if v.id not in kept)
    assert not ckptrepo_threads()


def test_no_thread_survives_teardown(tmp_path: Path, ckptrepo_threads) -> None:
    from torch.optim.optimizer import _global_optimizer_pre_hooks
    hooks = len(_global_optimizer_pre_hooks)
    ck = checkpoint_callback(tmp_path / "ck", every_n_train_steps=3, save_top_k=-1, save_last=True)
    fit(1, [ck], [CkptRepoIO(tmp_path / "repo")])
    assert not ckptrepo_threads()
    assert len(_global_optimizer_pre_hooks) == hooks   # the step watch's hook is gone too
    assert len(ckptrepo.open(tmp_path / "repo").tags()) == len(os.listdir(tmp_path / "ck"))
    # a resume that saves again
    fit(2, [checkpoint_callback(tmp_path / "ck", save_last=True)], [CkptRepoIO(tmp_path / "repo")], ckpt_path="last")
    assert not ckptrepo_threads() and len(_global_optimizer_pre_hooks) == hooks


@pytest.mark.parametrize("small", [True, False])
def test_the_second_step_after_a_save_waits_for_a_small_states_commit(tmp_path: Path, small: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash two optimizer steps after the save of a small state keeps it: the second step waits for its
    commit. A large state's write overlaps as many steps as it takes."""
    import ckptrepo.integrations.lightning as plugin
    if not small:
        monkeypatch.setattr(plugin, "SMALL_STATE_BYTES", 0)
    io = CkptRepoIO(tmp_path / "repo")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step() -> None:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    io.save_checkpoint({"state_dict": model.state_dict(), "global_step": 0}, tmp_path / "a.ckpt")
    train_step()   # attaches the optimizer
    held, release = threading.Event(), threading.Event()

    def hold(_name: str) -> None:
        held.set()
        release.wait(30)
    faults.set_hook("after_data", hold)
    io.save_checkpoint({"state_dict": model.state_dict(), "global_step": 1}, tmp_path / "b.ckpt")
    train_step()   # the first step waits for capture only
    assert held.wait(10)
    second = threading.Thread(target=train_step)
    second.start()
    second.join(0.5 if small else 10)
    assert second.is_alive() is small
    release.set()
    second.join(10)
    if not small:
        io.files.wait()
    assert "b.ckpt" in ckptrepo.open(tmp_path / "repo").tags()   # committed once the second step has run
    io.teardown()
