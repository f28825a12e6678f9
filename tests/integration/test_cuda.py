"""The CUDA path: pinned staging, copies on a side stream ordered by events, and loads onto the GPU.

Every test here needs a CUDA GPU and skips cleanly without one (CI has none). The truths are cloned on
the GPU, on the training stream, right after each ``snapshot()`` call, so nothing here synchronises
the host with the GPU between steps: the capture's copies race the next forward and backward for real,
and only the optimizer's pre-step wait may order them.
"""
from __future__ import annotations

import pytest
import torch
from support.helpers import assert_bit_exact

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _on_gpu_clone(state: dict) -> dict:
    """What a snapshot taken now must hold: a copy queued on the current stream, read back later."""
    return type(state)((k, _on_gpu_clone(v) if isinstance(v, dict) else v.detach().clone()
                        if isinstance(v, torch.Tensor) else v) for k, v in state.items())


def _to_cpu(state: dict) -> dict:
    return type(state)((k, _to_cpu(v) if isinstance(v, dict) else v.cpu() if isinstance(v, torch.Tensor) else v)
                       for k, v in state.items())


def _model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(64, 512, device="cuda", generator=g)
    loss = model(x).square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "pageable"])
def test_a_cuda_training_loop_snapshotted_every_step_is_bit_exact(repo, pin):
    """The lazy hook on the GPU: snapshot() after every step, the attached optimizer's next step waits for
    the capture, and every version equals the state at its step although training went straight on."""
    model, opt = _model_and_optimizer()
    g = torch.Generator(device="cuda").manual_seed(1)
    _step(model, opt, g)
    truths = {}
    with repo.snapshotter(host_memory="16MiB", pin_memory=pin) as snap:
        assert snap.pool.pin is pin
        snap.attach(opt)
        for step in range(6):
            _step(model, opt, g)
            snap.snapshot({"model": model, "optimizer": opt}, step=step)
            truths[step] = _on_gpu_clone({"model": model.state_dict(), "optimizer": opt.state_dict()})
        snap.wait()
    for step, truth in truths.items():
        out = repo.load(f"@{step}")
        assert_bit_exact(_to_cpu(truth)["model"], out["model"])
        assert_bit_exact(_to_cpu(truth)["optimizer"]["state"], out["optimizer"]["state"])


def test_awkward_cuda_tensors_round_trip(repo):
    """Views, a transposed (non-contiguous) tensor, 0-d and empty tensors, bf16, bool and integers, a
    state larger than the staging pool, and CPU tensors beside them."""
    g = torch.Generator(device="cuda").manual_seed(2)
    big = torch.randn(4096, 4096, device="cuda", generator=g)          # 64 MiB against a 16 MiB pool
    state = {"big": big, "transposed": big[:1000, :300].t(), "row": big[7],
             "bf16": torch.randn(333, 77, device="cuda", generator=g).bfloat16(),
             "scalar": torch.tensor(3.5, device="cuda"), "empty": torch.empty(0, 5, device="cuda"),
             "mask": torch.rand(1001, device="cuda", generator=g) > 0.5,
             "ids": torch.randint(-2**62, 2**62, (999,), device="cuda", generator=g),
             "cpu": torch.arange(17, dtype=torch.int16), "step": 12}
    with repo.snapshotter(host_memory="16MiB") as snap:
        snap.snapshot(state, step=0)
        truth = _on_gpu_clone(state)
        snap.wait_captured()
        big.zero_()                              # after the capture: the snapshot must not see it
        snap.wait()
    assert_bit_exact(_to_cpu(truth), repo.load("@0"))


def test_a_snapshot_taken_on_a_side_stream_orders_after_that_streams_work(repo):
    """The capture orders its copies after the stream current at snapshot(), not only the default one."""
    side = torch.cuda.Stream()
    w = torch.zeros(1 << 22, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)           # ~0.1 s of spinning queued ahead, so the fill is still pending
        w.fill_(50.0)                            # at snapshot() unless the capture waits for this stream
        with repo.snapshotter(host_memory="8MiB") as snap:
            snap.snapshot({"w": w}, step=0)
            snap.wait_captured()
            w.add_(1.0)                          # captured already: must not be seen
            snap.wait()
    assert torch.equal(repo.load("@0")["w"], torch.full((1 << 22,), 50.0))


def test_loads_onto_the_gpu_and_into_gpu_tensors(repo):
    model, opt = _model_and_optimizer(seed=3)
    g = torch.Generator(device="cuda").manual_seed(4)
    for _ in range(2):
        _step(model, opt, g)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    repo.snapshot(state, step=2)
    truth = _to_cpu(state)

    out = repo.load("@2", device="cuda")
    assert all(t.is_cuda for t in out["model"].values())
    assert_bit_exact(truth["model"], _to_cpu(out["model"]))

    model2, opt2 = _model_and_optimizer(seed=5)
    _step(model2, opt2, g)                       # moments exist, so into= fills them in place
    ptrs = [p.data_ptr() for p in model2.parameters()]
    repo.load("@2", into={"model": model2, "optimizer": opt2})
    assert [p.data_ptr() for p in model2.parameters()] == ptrs
    assert_bit_exact(truth["model"], _to_cpu(model2.state_dict()))
    assert_bit_exact(truth["optimizer"]["state"], _to_cpu(opt2.state_dict()["state"]))
    # the resumed pair trains on exactly as the original does
    g1, g2 = torch.Generator(device="cuda").manual_seed(9), torch.Generator(device="cuda").manual_seed(9)
    assert [_step(model, opt, g1).item() for _ in range(3)] == [_step(model2, opt2, g2).item() for _ in range(3)]


def test_the_pinned_pool_grows_to_a_snapshots_need_once_and_pins_no_more_than_its_buffers(repo):
    """After the first capture the pool holds a buffer per segment of it (grown in the background), so later
    captures take buffers instead of pinning them one by one; each pinned buffer is allocated at its size,
    not rounded up to the next power of two by torch's pinned allocator."""
    from ckptrepo.saving._writer import aligned_empty
    g = torch.Generator(device="cuda").manual_seed(6)
    state = {f"w{i}": torch.randn(3 << 20, device="cuda", generator=g) for i in range(6)}   # 72 MiB
    with repo.snapshotter(host_memory="256MiB") as snap:
        segments = -(-(72 << 20) // snap.shard_bytes)
        asked = []
        grow = snap.pool.grow_in_background
        snap.pool.grow_in_background = lambda n: (asked.append(n), grow(n))
        snap.snapshot(state, step=0)
        snap.wait()
        assert asked == [segments]
        grower = snap.pool._growing
        if grower is not None:
            grower.join(60)
        assert snap.pool._allocated == segments
        snap.snapshot(state, step=1)
        snap.wait()
        assert snap.pool._allocated == segments     # the second capture allocated nothing
    assert_bit_exact(_to_cpu(state), repo.load("@1"))
    buf = aligned_empty(64 << 20, 4096, pin=True)
    assert buf.is_pinned() and buf.data_ptr() % 4096 == 0 and buf.numel() == 64 << 20
    assert buf.storage_offset() == 0 and buf.untyped_storage().nbytes() == 64 << 20, "pinned one page more"
