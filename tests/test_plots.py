import io

import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")

from helpers import plots  # noqa: E402


def test_stacked_bar_stacks_columns_and_stays_small():
    plots.use_style()
    df = pd.DataFrame({"weights": [1.0, 1.0], "gradients": [0.0, 1.0], "optimizer states": [0.0, 2.0]},
                      index=["load", "step"])
    fig = plots.stacked_bar(df, title="t", ylabel="memory (GiB)")
    ax = fig.axes[0]
    tops = sorted({round(p.get_y() + p.get_height(), 6) for p in ax.patches})
    assert tops[-1] == pytest.approx(4.0)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.tell() < 300_000
    with pytest.raises(ValueError):
        plots.stacked_bar(pd.DataFrame(), title="t", ylabel="y")


def test_lines_checks_columns():
    df = pd.DataFrame({"batch": [1, 2, 4], "mib": [1.0, 2.0, 4.0]})
    fig = plots.lines(df, x="batch", ys=["mib"], title="t", xlabel="batch size", ylabel="memory (MiB)", logx=True)
    assert len(fig.axes[0].lines) == 1
    with pytest.raises(ValueError, match="columns not in the frame: gib"):
        plots.lines(df, x="batch", ys=["gib"], title="t", xlabel="x", ylabel="y")
