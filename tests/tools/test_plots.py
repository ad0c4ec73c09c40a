"""The loss-vs-ε plot: a long title stays on the figure, the legend names only what is drawn."""
import matplotlib

matplotlib.use("Agg", force=True)

import matplotlib.pyplot as plt  # noqa: E402

from longshield_fx.cli.train_report import plot_title  # noqa: E402
from longshield_fx.tools import plots  # noqa: E402


def test_a_long_model_path_stays_inside_the_figure_and_the_legend_matches_the_lines(tmp_path, monkeypatch):
    name = "HF LlamaForCausalLM (/home/someone/very/long/path/to/a/fine-tuned/checkpoint-directory/model) + LoRA r=16 (all-linear)"
    title = plot_title(name, 1024, {"expected_batch_size": 8}, 1.2)
    rows = [{"epsilon": 0.1 * i, "loss": 5 - 0.01 * i, "eval_loss": 5.1 if i == 2 else None} for i in range(1, 4)]
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))  # keep the figure to look at it
    plots.loss_vs_epsilon(rows, tmp_path / "p.png", title=title)
    (fig,) = figures
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    box, frame = ax.title.get_window_extent(renderer), fig.bbox
    assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and box.y1 <= frame.y1, (box, frame)
    assert "checkpoint-directory" in ax.get_title().replace("\n", " ")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    drawn = [line.get_label() for line in ax.get_lines() if len(line.get_xdata())]
    assert labels == drawn == ["training loss, per step", "held-out loss"]  # 3 steps: no running mean
