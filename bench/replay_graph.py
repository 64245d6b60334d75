"""CUDA-graph capture of a single-rank stack of replayed MoE layers, timed against the eager forward.

A stack of ``--layers`` :class:`~relibra_moe.layers.moe.ReplayBalancedMoE` layers (``h = h + moe(h)``) on one
rank replays recorded routing: inside ``replay`` every layer follows its host-built schedule, so its forward
launches work without a host sync and at fixed shapes (``T * k`` sorted rows per layer). The forward (no grad)
is captured once in a ``torch.cuda.CUDAGraph`` while following micro-batch A's schedules; then micro-batch B's
schedules are copied into A's (``LayerSchedule.copy_``) together with B's tokens, and the graph is replayed.
Checked: the replay equals the eager forward of B (max abs error; the same kernels run, so it is expected to be
0). Timed (CUDA events, median): the eager forward and the graph replay.

Without CUDA (the dry run) nothing is captured: the same steps run eagerly on CPU at tiny shapes (the schedule
refresh included, checked against the eager forward of B), and the capture is recorded as not run.

    python bench/replay_graph.py --out /tmp/replay_graph.json            # CUDA: 8 layers, 4096 tokens, bf16
    python bench/replay_graph.py --tiny --out /tmp/replay_graph.json     # CPU dry run

Exit code 1 when an output differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import JsonReport, environment, select_kernel_mode, time_ms

select_kernel_mode()  # before Triton is imported

from relibra_moe.layers.moe import ReplayBalancedMoE  # noqa: E402
from relibra_moe.layers.replay import replay  # noqa: E402


def _forward(layers: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    h = x
    for layer in layers:
        h = h + layer(h)
    return h


def _recorded(layers: torch.nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor]:
    """The ids each layer chooses live for ``x`` (a recorded rollout), on the host."""
    with torch.no_grad():
        _forward(layers, x)
    return [layer.last_routing.cpu().clone() for layer in layers]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU dry run)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    iters = args.iters if cuda else 2  # the interpreter is slow: the dry run checks, it does not time
    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.bfloat16 if cuda else torch.float32
    tiny = args.tiny or not cuda
    T, H, Fh, E, k, L = (16, 32, 16, 8, 2, 2) if tiny else (args.tokens, 2048, 768, 128, 8, args.layers)
    rep = JsonReport(Path(args.out), environment=environment(), shape=dict(T=T, H=H, ffn=Fh, E=E, k=k, layers=L))
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([ReplayBalancedMoE(H, Fh, E, k, layer_index=i, dtype=dt, device=dev)
                                  for i in range(L)]).eval()
    with torch.no_grad():
        for layer in layers:
            layer.router.weight.mul_(4.0)  # distinct top-k choices: A and B route differently
    g = torch.Generator(device=dev).manual_seed(1)
    xa = torch.randn(T, H, generator=g, device=dev, dtype=dt)
    xb = torch.randn(T, H, generator=g, device=dev, dtype=dt)
    ids_a, ids_b = _recorded(layers, xa), _recorded(layers, xb)
    with torch.no_grad():
        with replay(layers, ids_b):
            ref_b = _forward(layers, xb)
            states_b = [layer.replay_state for layer in layers]
        with replay(layers, ids_a):
            static_x = xa.clone()
            eager_ms = time_ms(lambda: _forward(layers, static_x), iters, 1)
            if cuda:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        _forward(layers, static_x)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_y = _forward(layers, static_x)
            for layer, sb in zip(layers, states_b):  # micro-batch B's routing into the followed schedules
                layer.replay_state.schedule.copy_(sb.schedule)
            static_x.copy_(xb)
            if cuda:
                graph.replay()
                out = static_y.clone()
                graph_ms = time_ms(graph.replay, iters, 3)
            else:
                out = _forward(layers, static_x)
    err = float((out.float() - ref_b.float()).abs().max())
    differ = any(not torch.equal(a, b) for a, b in zip(ids_a, ids_b))  # else the refresh would prove nothing
    ok = differ and (err == 0.0 or (not cuda and err < 1e-5))
    rep.set("routing_a_differs_from_b", differ)
    rep.set("max_abs_err_vs_eager_b", err)
    rep.set("ok", ok)
    rep.set("eager_forward_ms", eager_ms)
    if cuda:
        rep.set("capture", "captured and replayed with micro-batch B's schedules")
        rep.set("graph_replay_ms", graph_ms)
        rep.set("speedup", eager_ms / graph_ms)
        print(f"eager {eager_ms:.3f} ms, graph {graph_ms:.3f} ms ({eager_ms / graph_ms:.2f}x), max err {err:g}")
    else:
        rep.set("capture", "not run (no CUDA): the schedule refresh checked eagerly")
        print(f"no CUDA: eager {eager_ms:.3f} ms, refreshed schedules max err {err:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
