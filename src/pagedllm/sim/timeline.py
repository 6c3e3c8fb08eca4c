"""The timeline plot of simulated or replayed runs: KV memory, batch and fragmentation over time."""

from __future__ import annotations

from pathlib import Path

from pagedllm.sim.simulator import SimulationResult


def plot_timeline(results: dict[str, SimulationResult], path: Path, title: str, xlabel: str) -> None:
    """One PNG, three panels over time for each run: KV memory held, sequences in the step, and
    fragmentation. Shared by ``simulate --plot`` and ``bench compare --plot``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak = max((s.used_blocks * r.bytes_per_block for r in results.values() for s in r.steps), default=0)
    unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    for name, res in results.items():
        t = [s.time for s in res.steps]
        per_token = res.bytes_per_block / res.block_size
        axes[0].plot(t, [s.used_blocks * (s.block_size or res.block_size) * per_token / scale for s in res.steps],
                     label=name)
        axes[1].plot(t, [s.num_seqs for s in res.steps], label=name)
        axes[2].plot(t, [100 * s.fragmentation for s in res.steps], label=name)
    for ax, label in zip(axes, (f"KV memory held ({unit})", "sequences in the step", "fragmentation (%)"),
                         strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[2].set_xlabel(xlabel)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
