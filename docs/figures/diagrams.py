"""The drawings in the docs, as SVG written by code (no drawing program, no dependency): a fit from the
command to the optimizer step (docs/architecture.md) and a composed device mesh
(docs/strategies/composition.md).

    python docs/figures/diagrams.py            # rewrites docs/figures/fit.svg and mesh.svg

tests/test_figures.py checks that the committed files are what this script draws.
"""

from __future__ import annotations

import argparse
import os
from html import escape

HERE = os.path.dirname(os.path.abspath(__file__))
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"


def _svg(width: int, height: int, body: list[str]) -> str:
    head = (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
            f"viewBox='0 0 {width} {height}' {FONT} font-size='12'>")
    marker = ("<defs><marker id='arrow' markerWidth='8' markerHeight='8' refX='7' refY='4' orient='auto'>"
              "<path d='M0,0 L8,4 L0,8 z' fill='#444'/></marker></defs>")
    background = f"<rect width='{width}' height='{height}' fill='white'/>"
    return "\n".join([head, marker, background, *body, "</svg>", ""])


def _box(x: int, y: int, w: int, h: int, title: str, lines: tuple[str, ...] = (),
         fill: str = "#eef3fb") -> list[str]:
    out = [f"<rect x='{x}' y='{y}' width='{w}' height='{h}' rx='6' fill='{fill}' stroke='#5b7db1'/>",
           f"<text x='{x + 8}' y='{y + 17}' font-weight='bold'>{escape(title)}</text>"]
    out += [f"<text x='{x + 8}' y='{y + 33 + 14 * i}' fill='#333'>{escape(line)}</text>"
            for i, line in enumerate(lines)]
    return out


def _arrow(x1: int, y1: int, x2: int, y2: int, label: str = "") -> list[str]:
    out = [f"<line x1='{x1}' y1='{y1}' x2='{x2}' y2='{y2}' stroke='#444' marker-end='url(#arrow)'/>"]
    if label:
        out.append(f"<text x='{(x1 + x2) // 2 + 6}' y='{(y1 + y2) // 2 + 4}' fill='#555' font-size='11'>"
                   f"{escape(label)}</text>")
    return out


def fit_svg() -> str:
    """A fit, top to bottom: who calls whom, and the file each piece lives in."""
    body: list[str] = []
    steps = [
        ("polytrain fit -c cfg.yaml / trainer.fit(module)",
         ("cli.py: config checked, --ckpt checked, workers launched", "trainer/trainer.py: Trainer._run")),
        ("stage set-up",
         ("configure_callbacks, seeding, run directory claimed (run_directory.py)",
          "prepare_data, setup, configure_model, strategy.setup_module (lifecycle.py)")),
        ("FitLoop.run (trainer/loops/fit_loop.py)",
         ("configure_optimizers, resume (resume.py), sanity check", "on_fit_start, on_train_start")),
    ]
    y = 20
    for title, lines in steps:
        body += _box(40, y, 560, 30 + 14 * len(lines), title, lines)
        bottom = y + 30 + 14 * len(lines)
        y = bottom + 30
        body += _arrow(320, bottom, 320, y - 2)
    epoch_top = y
    body.append(f"<rect x='20' y='{epoch_top}' width='600' height='290' rx='8' fill='#fbfbf4' "
                f"stroke='#b1a55b' stroke-dasharray='5,3'/>")
    body.append(f"<text x='32' y='{epoch_top + 18}' font-weight='bold' fill='#7a6f24'>"
                f"every epoch, every batch</text>")
    batch = [
        ("fetch + transfer", ("data/loaders.py: DistributedSampler, set_epoch",)),
        ("forward / backward through the strategy",
         ("training_step, on_before_backward, backward (strategies/)",)),
        ("clip, optimizer step, zero_grad, schedulers",
         ("trainer/loops/optimization.py, strategy.optimizer_step",)),
        ("on_train_batch_end: log, checkpoint (callbacks/)",
         ("ModelCheckpoint -> checkpoint/ (atomic, checksummed)",)),
    ]
    y = epoch_top + 32
    for i, (title, lines) in enumerate(batch):
        body += _box(60, y, 520, 44, title, lines, fill="#f6f1d8")
        if i < len(batch) - 1:
            body += _arrow(320, y + 44, 320, y + 62)
        y += 62
    # The next batch: back up from the batch's end to the fetch.
    body.append(f"<path d='M580,{y - 40} L600,{y - 40} L600,{epoch_top + 54} L582,{epoch_top + 54}' "
                f"fill='none' stroke='#444' marker-end='url(#arrow)'/>")
    y = epoch_top + 300
    body += _arrow(320, epoch_top + 290, 320, y + 18, "validation when due, epoch end")
    body += _box(40, y + 20, 560, 44, "on_fit_end, last checkpoint on disk, teardown",
                 ("fit returns (or raises on every rank)",))
    return _svg(640, y + 80, body)


COLORS = {"tp": "#d8e7fb", "dp_shard": "#e3f5dc", "pp": "#fbe4d8"}


def mesh_svg(pp: int = 2, dp_shard: int = 2, tp: int = 2) -> str:
    """The ranks of a ``pp x dp_shard x tp`` mesh laid out as polytrain numbers them (tp innermost), with
    the groups they communicate in drawn as the links between them."""
    body: list[str] = [f"<text x='20' y='24' font-weight='bold'>mesh (pp={pp}, dp_shard={dp_shard}, "
                       f"tp={tp}): {pp * dp_shard * tp} ranks, tp innermost</text>"]
    cell, gap = 70, 30
    panel_w, panel_h = tp * (cell + gap) - gap + 40, dp_shard * (cell + gap) - gap + 56
    for p in range(pp):
        x0, y0 = 20 + p * (panel_w + 60), 44
        body.append(f"<rect x='{x0}' y='{y0}' width='{panel_w}' height='{panel_h}' rx='8' "
                    f"fill='{COLORS['pp']}' stroke='#b1765b'/>")
        body.append(f"<text x='{x0 + 10}' y='{y0 + 18}' font-weight='bold'>pipeline stage {p}</text>")
        center = [[(x0 + 20 + t * (cell + gap) + cell // 2, y0 + 36 + s * (cell + gap) + cell // 2)
                   for t in range(tp)] for s in range(dp_shard)]
        for row in center:  # tp groups: the ranks of a row
            body.append(f"<line x1='{row[0][0]}' y1='{row[0][1]}' x2='{row[-1][0]}' y2='{row[-1][1]}' "
                        f"stroke='#5b7db1' stroke-width='8'/>")
        for t in range(tp):  # dp_shard groups: the ranks of a column
            body.append(f"<line x1='{center[0][t][0]}' y1='{center[0][t][1]}' x2='{center[-1][t][0]}' "
                        f"y2='{center[-1][t][1]}' stroke='#5bb165' stroke-width='8'/>")
        for s in range(dp_shard):
            for t in range(tp):
                rank = (p * dp_shard + s) * tp + t
                cx, cy = center[s][t]
                body.append(f"<rect x='{cx - cell // 2}' y='{cy - cell // 2}' width='{cell}' height='{cell}' "
                            f"rx='6' fill='white' stroke='#333'/>")
                body.append(f"<text x='{cx}' y='{cy - 3}' text-anchor='middle' font-size='15' "
                            f"font-weight='bold'>rank {rank}</text>")
                body.append(f"<text x='{cx}' y='{cy + 17}' text-anchor='middle' font-size='10' fill='#555'>"
                            f"dp {s}, tp {t}</text>")
        if p < pp - 1:
            body += _arrow(x0 + panel_w + 6, y0 + panel_h // 2, x0 + panel_w + 52, y0 + panel_h // 2)
    y = 44 + panel_h + 30
    legend = [("tp group: linked across a row (a layer's matmuls split over them, all-reduced in every "
               "layer)", "#5b7db1"),
              ("dp_shard group: linked down a column (FSDP: parameters gathered per block, gradients "
               "reduce-scattered)", "#5bb165"),
              ("pp: the same place in the next stage (activations sent forward, their gradients back)",
               "#b1765b")]
    for i, (text, color) in enumerate(legend):
        body.append(f"<rect x='20' y='{y + 22 * i - 11}' width='14' height='14' fill='{color}'/>")
        body.append(f"<text x='42' y='{y + 22 * i}'>{escape(text)}</text>")
    return _svg(max(20 + pp * (panel_w + 60), 740), y + 22 * len(legend) + 10, body)


DRAWINGS = {"fit.svg": fit_svg, "mesh.svg": mesh_svg}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=HERE)
    args = parser.parse_args()
    for name, draw in DRAWINGS.items():
        path = os.path.join(args.out_dir, name)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(draw())
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
