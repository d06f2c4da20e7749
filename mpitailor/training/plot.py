"""`python -m mpitailor stats plot stats.h5 -o plot.png`: layer x step heatmaps (one column
per step at which a save was attempted, in step order) of the relative update since each
layer's last save, and of which layers each save published (green) or chose but never
published (red: its asynchronous write failed, or the run was killed in it)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mpitailor.errors import UserError


def plot_stats(path: Path, out: Path) -> None:
    try:
        import h5py
        import matplotlib
    except ImportError as e:
        raise UserError(f"stats plot needs matplotlib and h5py ({e.name} is not installed): "
                        "pip install 'mpitailor[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        with h5py.File(path, "r") as f:
            layers = [x.decode() for x in f["layers"][:]]
            steps, rel, saved = f["step"][:], f["relative_update"][:], f["saved"][:]
            chosen = f["chosen"][:] if "chosen" in f else saved  # older logs: no `chosen`
    except (OSError, KeyError) as e:
        raise UserError(f"{path}: not an mpitailor stats file ({e})") from None
    rel = np.where(np.isfinite(rel), rel, np.nan)
    state = np.where(saved, 2, np.where(chosen, 1, 0))  # saved, chosen only, neither
    fig, axes = plt.subplots(1, 2, figsize=(4 + 0.5 * len(steps), 1.5 + 0.3 * len(layers)),
                             sharey=True)
    im = axes[0].imshow(np.log10(rel.T), aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=axes[0], label="log10 relative update since last save")
    colours = matplotlib.colors.ListedColormap(["white", "tab:red", "tab:green"])
    axes[1].imshow(state.T, aspect="auto", cmap=colours, vmin=0, vmax=2,
                   interpolation="nearest")
    for ax, title in zip(axes, ("update since last save",
                                "saved (green), never published (red)")):
        ax.set_title(title)
        ax.set_xticks(range(len(steps)), [str(s) for s in steps], rotation=90)
        ax.set_xlabel("step")
    axes[0].set_yticks(range(len(layers)), layers)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
