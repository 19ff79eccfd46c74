"""The sweep's picture: throughput and latency against concurrency (or request rate), knee marked.

matplotlib with the Agg backend (no display needed), imported only here.
"""

from __future__ import annotations


def plot_sweep(result: dict, path: str) -> None:
    """result: the sweep's JSON document (levels sorted by x, verdict possibly None)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    x_key = result["x"]  # "concurrency" or "request_rate"
    xs = [lv[x_key] for lv in levels]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)

    top.plot(xs, [lv["output_tok_s"] for lv in levels], "o-", label="output tok/s")
    top.plot(xs, [lv["total_tok_s"] for lv in levels], "s--", alpha=0.6, label="total tok/s")
    unsteady = [lv for lv in levels if not lv.get("steady", {}).get("steady", True)]
    if unsteady:  # left out of the knee rules: their figures depend on when the window fell
        top.plot(
            [lv[x_key] for lv in unsteady],
            [lv["output_tok_s"] for lv in unsteady],
            "x",
            color="tab:red",
            markersize=12,
            label="not steady",
        )
    top.set_ylabel("tokens / s")
    top.grid(True, alpha=0.3)

    def series(key: str, q: str) -> list[float]:
        return [lv[key][q] if lv[key][q] is not None else float("nan") for lv in levels]

    bottom.plot(xs, series("ttft_ms", "p50"), "o-", label="TTFT p50")
    bottom.plot(xs, series("ttft_ms", "p99"), "o:", label="TTFT p99")
    bottom.plot(xs, series("tpot_ms", "p50"), "s-", label="TPOT p50")
    bottom.plot(xs, series("itl_ms", "p99"), "s:", label="ITL p99")
    bottom.set_yscale("log")
    bottom.set_ylabel("latency (ms)")
    bottom.grid(True, which="both", alpha=0.3)
    bottom.set_xlabel(
        "concurrency (requests in flight)" if x_key == "concurrency" else "request rate (req/s)"
    )

    verdict = result.get("verdict")
    if verdict:
        for ax in (top, bottom):
            ax.axvline(verdict["knee_x"], color="tab:red", linestyle="--", alpha=0.7)
        top.annotate(
            f"knee {verdict['knee_x']:g}: {verdict['knee_output_tok_s']:.0f} tok/s\n({verdict['reason']})",
            xy=(verdict["knee_x"], verdict["knee_output_tok_s"]),
            xytext=(-10, -40),
            textcoords="offset points",
            color="tab:red",
            ha="right",
        )
        top.plot(
            [verdict["best_x"]],
            [verdict["best_output_tok_s"]],
            "*",
            markersize=14,
            color="tab:orange",
            label=f"best {verdict['best_x']:g}",
        )
    if len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 4:
        top.set_xscale("log", base=2)
        top.set_xticks(xs, [f"{x:g}" for x in xs])
        top.minorticks_off()
    top.legend(loc="upper left")
    bottom.legend(loc="upper left")
    server = result.get("server", {})
    top.set_title(
        f"{server.get('model', '')}  in {result['workload']['input_len']} / "
        f"out {result['workload']['output_len']} tokens  {result.get('gpu', '')}".strip()
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
