"""Tables, ``results.json`` and the TTFA plots of a benchmark run."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

COLUMNS = (
    # header, summary key, format
    ("conc", "concurrency", "{:>4}"),
    ("n", "n", "{:>4}"),
    ("err", "errors", "{:>4}"),
    ("ttfa p50", "ttfa_p50_ms", "{:>9}"),
    ("p90", "ttfa_p90_ms", "{:>8}"),
    ("p99", "ttfa_p99_ms", "{:>8}"),
    ("1st chunk p50", "first_chunk_p50_ms", "{:>13}"),
    ("total p50", "total_p50_ms", "{:>10}"),
    ("RTF mean", "rtf_mean", "{:>8}"),
    ("underruns", "underruns", "{:>9}"),
    ("% req", "underrun_requests_pct", "{:>6}"),
    ("min buf ms", "least_buffered_min_ms", "{:>10}"),
    ("audio s/s", "throughput_audio_s_per_s", "{:>9}"),
)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def table(summaries: Sequence[dict], title: str | None = None) -> str:
    """A fixed-width table, one row per concurrency level (times in ms)."""
    lines = [title] if title else []
    lines.append("  ".join(fmt.format(header) for header, _, fmt in COLUMNS))
    for summary in summaries:
        lines.append("  ".join(fmt.format(_cell(summary.get(key))) for _, key, fmt in COLUMNS))
    return "\n".join(lines)


def markdown_table(summaries: Sequence[dict]) -> str:
    head = "| " + " | ".join(h for h, _, _ in COLUMNS) + " |"
    rule = "|" + "---|" * len(COLUMNS)
    rows = ["| " + " | ".join(_cell(s.get(key)) for _, key, _ in COLUMNS) + " |" for s in summaries]
    return "\n".join([head, rule, *rows])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def host_info() -> dict:
    """What the numbers ran on: CPU, GPU (through torch, when importable), versions, load."""
    info: dict = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }
    try:
        import torch  # optional: only for the GPU's name and the version

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no torch, or a broken CUDA setup: leave the GPU out
        pass
    info.setdefault("gpu", None)
    return info


def write_results(out_dir: Path, mode: str, params: dict, levels: Sequence[dict], host: dict) -> Path:
    """``results.json``: parameters, host, and per level its summary and every request's record."""
    path = out_dir / "results.json"
    path.write_text(json.dumps({"mode": mode, "params": params, "host": host, "levels": list(levels)}, indent=1))
    return path


def load_results(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_runs(runs: Sequence[tuple[str, dict]], path: Path, metric: str = "ttfa", title: str | None = None) -> Path:
    """``metric`` p50 (solid) and p90 (dashed) vs concurrency for each (label, results) in one PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for i, (label, results) in enumerate(runs):
        summaries = [level["summary"] for level in results["levels"]]
        color = f"C{i}"
        for q, style in ((50, "-"), (90, "--")):
            points = [(s["concurrency"], s.get(f"{metric}_p{q}_ms")) for s in summaries]
            points = [(c, v) for c, v in points if v is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{label} p{q}")
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    levels = sorted({lv["summary"]["concurrency"] for _, results in runs for lv in results["levels"]})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(levels))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("concurrency (streams)")
    name = metric.replace("_", " ").replace("ttfa", "TTFA")
    ax.set_ylabel(f"{name} (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title or f"{name} vs concurrency")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def try_plot(runs: Sequence[tuple[str, dict]], path: Path, metric: str = "ttfa", title: str | None = None) -> Path | None:
    """``plot_runs``, or a warning when matplotlib is not installed (the numbers are in results.json)."""
    try:
        return plot_runs(runs, path, metric, title)
    except ImportError as exc:
        print(f"[bench] no plot ({exc}); install the 'bench' extra for matplotlib", file=sys.stderr)
        return None


def compare_table(runs: Sequence[tuple[str, dict]], metric: str = "ttfa") -> str:
    """p50/p90 of ``metric`` per concurrency, one column pair per run (the first run is the baseline)."""
    levels = sorted({s["summary"]["concurrency"] for _, r in runs for s in r["levels"]})
    header = ["conc"] + [f"{label} p50/p90 ms" for label, _ in runs]
    lines = ["  ".join(f"{h:>22}" if i else f"{h:>4}" for i, h in enumerate(header))]
    for c in levels:
        cells = [f"{c:>4}"]
        base = None
        for label, results in runs:
            s = next((lv["summary"] for lv in results["levels"] if lv["summary"]["concurrency"] == c), None)
            if s is None:
                cells.append(f"{'-':>22}")
                continue
            p50, p90 = s.get(f"{metric}_p50_ms"), s.get(f"{metric}_p90_ms")
            text = f"{_cell(p50)}/{_cell(p90)}"
            if base is None:
                base = p50
            elif base and p50 is not None:
                text += f" ({(p50 - base) / base * 100:+.0f}%)"
            cells.append(f"{text:>22}")
        lines.append("  ".join(cells))
    return "\n".join(lines)
