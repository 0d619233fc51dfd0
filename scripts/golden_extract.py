"""Read the numbers the book prints out of the committed notebook outputs into ``tests/golden/*.json``.

The chapters' ``.ipynb`` files carry the outputs of a real GPU run (their ``metadata.gpubook.execution``
says which GPU, which commit and when). The golden tests (``tests/test_golden_numbers.py``) compare the
helpers' CPU arithmetic with those numbers; they read the JSON written here, never the notebooks, so that
they stay fast and do not change when a chapter's prose does.

Run it again after a GPU re-run of the chapters to refresh the fixtures, and read the diff: a number that
moved is either the GPU's (a new measurement) or a changed helper (then the test says which)::

    PYTHONPATH=$PWD python scripts/golden_extract.py            # writes tests/golden/*.json
    PYTHONPATH=$PWD python scripts/golden_extract.py --check    # exit 1 if a fixture would change

Each fixture records its sources: notebook, cell id, and the run's date, commit, GPU and profile. A cell
that is missing, has no output, or prints a table of another shape stops the script with a message: a
fixture is never written from a CPU (tiny-profile) run or from a cell that did not run.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
GOLDEN = ROOT / "tests" / "golden"
GIB = 2**30


class ExtractError(RuntimeError):
    """A notebook does not hold what a fixture needs."""


# ------------------------------------------------------------------------------------------------------
# Reading a notebook's outputs


def load(notebook: str) -> dict:
    return json.loads((NOTEBOOKS / notebook).read_text())


def run_info(nb: dict, notebook: str) -> dict:
    ex = nb.get("metadata", {}).get("gpubook", {}).get("execution", {})
    info = {"notebook": f"notebooks/{notebook}", "run_date": ex.get("date"), "commit": ex.get("commit"),
            "gpu": ex.get("gpu"), "profile": ex.get("profile")}
    if info["profile"] != "full" or not info["gpu"]:
        raise ExtractError(f"{notebook}: the committed outputs are not a full-profile GPU run ({info}): "
                           "golden fixtures come only from GPU runs")
    return info


def cell(nb: dict, notebook: str, cell_id: str) -> dict:
    found = [c for c in nb["cells"] if c.get("id") == cell_id]
    if len(found) != 1:
        raise ExtractError(f"{notebook}: expected one cell with id {cell_id!r}, found {len(found)}")
    if not found[0].get("outputs"):
        raise ExtractError(f"{notebook}: cell {cell_id} has no outputs (not executed?)")
    return found[0]


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def outputs(c: dict, kind: str) -> list[str]:
    """The cell's outputs of one MIME type (``"stream"`` for printed text), in order."""
    out = []
    for o in c["outputs"]:
        if kind == "stream" and o["output_type"] == "stream":
            out.append(_text(o["text"]))
        elif kind != "stream" and kind in o.get("data", {}):
            out.append(_text(o["data"][kind]))
    return out


def source_of(info: dict, cell_id: str, what: str) -> dict:
    return {**info, "cell_id": cell_id, "what": what}


# ------------------------------------------------------------------------------------------------------
# Parsing tables: pandas' HTML (DataFrame and Styler) and pandas' fixed-width text


class _Tables(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[-1].append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def html_table(html: str) -> list[dict[str, str]]:
    """The first table of pandas' HTML as records keyed by column name; the row labels under ``""``
    (a MultiIndex's labels joined by ``" | "``, the blank cells of a repeated label filled in)."""
    p = _Tables()
    p.feed(html)
    if not p.tables:
        raise ExtractError("no <table> in the output")
    rows = p.tables[0]
    header = rows[0]
    n_data = sum(1 for h in header if h.strip())  # data columns have names; the index corner is blank
    body = [r for r in rows[1:] if len(r) >= n_data and any(x.strip() for x in r[len(r) - n_data:])]
    records, last_labels = [], []
    for r in body:
        labels, data = r[: len(r) - n_data], r[len(r) - n_data:]
        if len(data) != n_data:
            continue
        if last_labels and len(labels) < len(last_labels):  # a MultiIndex row that repeats its first label
            labels = last_labels[: len(last_labels) - len(labels)] + labels
        last_labels = labels
        records.append({"": " | ".join(labels), **dict(zip([h for h in header if h.strip()], data, strict=True))})
    return records


_NUM = r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+|nan|NaN)"


def text_table(text: str) -> list[dict]:
    """pandas' fixed-width text (``to_string``): a header line, then rows of a label and numbers."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = lines[0].strip()
    cols = re.split(r"\s{2,}", header)
    records = []
    for ln in lines[1:]:
        m = re.match(rf"^(.*?)((?:\s+{_NUM})+)\s*$", ln)
        if not m:
            raise ExtractError(f"cannot read the table row {ln!r}")
        nums = [number(x) for x in m.group(2).split()]
        if len(nums) != len(cols):
            raise ExtractError(f"row {ln!r}: {len(nums)} numbers for the {len(cols)} columns {cols}")
        records.append({"": m.group(1).strip(), **dict(zip(cols, nums, strict=True))})
    return records


def number(text: str) -> float:
    text = text.strip().replace(",", "")
    if text in ("—", "", "nan", "NaN"):
        return float("nan")
    return float(text)


def nan_to_none(x: float) -> float | None:
    return None if isinstance(x, float) and math.isnan(x) else x


# ------------------------------------------------------------------------------------------------------
# The fixtures


def ch10_validation() -> dict:
    """Chapter 10, section 10.2: 35 setups, the planner's predicted peak against the H100's measured one."""
    name = "10_capstone.ipynb"
    nb = load(name)
    info = run_info(nb, name)
    cid = "9423749b"
    rows = html_table(outputs(cell(nb, name, cid), "text/html")[0])
    from helpers import plan  # the planner, to sharpen the measured peak printed with two decimals

    setups = plan.VALIDATION_SETUPS
    if len(rows) != len(setups):
        raise ExtractError(f"{name}: {len(rows)} validation rows, but plan.VALIDATION_SETUPS has {len(setups)}")
    out = []
    for r in rows:
        i = int(r[""])
        s = setups[i - 1]
        label = r["setup"].removesuffix("...")
        if not s.label().startswith(label):
            raise ExtractError(f"row {i}: the notebook's setup {r['setup']!r} is not plan.VALIDATION_SETUPS[{i - 1}] "
                               f"({s.label()!r}): regenerate after the run that matches the code")
        pred, meas, err = number(r["predicted peak (GiB)"]), number(r["measured peak (GiB)"]), number(r["planner error (%)"])
        row = {"row": i, "setup": s.label(), "predicted_gib": pred, "measured_gib": nan_to_none(meas),
               "error_pct": nan_to_none(err), "predicted_phase": r["predicted phase"], "measured_phase": r["measured phase"]}
        # The table prints GiB with two decimals (0.15% of a 3 GiB peak) but the error with two decimals of a
        # percent. When today's planner still predicts what the run printed, measured = predicted / (1 + error)
        # is exact to about 0.005% of the peak; it must round to the printed measured value.
        if not math.isnan(meas):
            now = plan.predict(s).peak_bytes
            if round(now / GIB, 2) == pred:
                exact = now / (1 + err / 100)
                if abs(exact / GIB - meas) > 0.0051:
                    raise ExtractError(f"row {i}: predicted/(1+error) = {exact / GIB:.4f} GiB does not round to the "
                                       f"printed measured peak {meas} GiB")
                row["measured_bytes"] = round(exact)
                row["measured_bytes_basis"] = "today's predicted bytes / (1 + printed error)"
            else:
                row["measured_bytes"] = round(meas * GIB)
                row["measured_bytes_basis"] = "printed GiB (2 decimals): the planner has changed since the run"
        out.append(row)
    return {"sources": [source_of(info, cid, "validation table: predicted vs measured peak per setup")],
            "rows": out}


def ch01_bytes() -> dict:
    """Chapter 1: bert-large's parameters and weight bytes, its fp32 AdamW bytes per parameter (rule and
    counted), and the 1.3B fp16 model's weights, gradients and AdamW states in GiB."""
    name = "01_memory_anatomy.ipynb"
    nb = load(name)
    info = run_info(nb, name)
    printed = outputs(cell(nb, name, "c05"), "stream")[0]
    m = re.search(r"([\d,]+) parameters -> ([\d,]+) MiB of fp32 weights", printed)
    if not m:
        raise ExtractError(f"{name} c05: no 'N parameters -> M MiB' line in {printed!r}")
    bpp = {r[""]: {"rule": r["rule (bytes/param)"], "counted": r["counted (bytes/param)"]}
           for r in text_table(outputs(cell(nb, name, "c19"), "stream")[0])}
    llm = {}
    for r in html_table(outputs(cell(nb, name, "c32"), "text/html")[0]):
        if r["result"] == "ok":
            llm[r[""]] = {k: number(r[k]) for k in ("model (GiB)", "gradients (GiB)", "optimizer (GiB)")}
    if not llm:
        raise ExtractError(f"{name} c32: no batch ran")
    return {
        "sources": [source_of(info, "c05", "bert-large parameters and fp32 weight MiB"),
                    source_of(info, "c19", "fp32 AdamW bytes per parameter: rule and counted"),
                    source_of(info, "c32", "polyglot-ko-1.3b fp16 AdamW: model, gradients, optimizer GiB per batch")],
        "bert_large": {"params": int(m.group(1).replace(",", "")), "weights_mib": number(m.group(2))},
        "fp32_adamw_bytes_per_param": bpp,
        "gpt_neox_1_3b_fp16_adamw_gib": llm,
    }


def ch05_optimizer_states() -> dict:
    """Chapter 5: model-state bytes per parameter by recipe (section 5.1) and optimizer-state bytes per
    parameter by optimizer (section 5.4), bert-large with fp32 weights."""
    name = "05_mixed_precision_optimizers.ipynb"
    nb = load(name)
    info = run_info(nb, name)
    recipes = {r[""]: {k: v for k, v in r.items() if k} for r in text_table(outputs(cell(nb, name, "c10"), "stream")[0])}
    table = {r[""]: number(r["state (bytes/param)"])
             for r in html_table(outputs(cell(nb, name, "575ba1b9"), "text/html")[0])}
    prose = outputs(cell(nb, name, "6ffc7155"), "text/markdown")[0]
    m = re.search(r"The measured states per parameter: (.*?)\. The rules", prose)
    if not m:
        raise ExtractError(f"{name} 6ffc7155: no 'The measured states per parameter: ...' sentence")
    three_digits = {what: float(x) for x, what in re.findall(r"([\d.]+) bytes for ([^,]+?)(?:, |$)", m.group(1))}
    if set(three_digits) != set(table):
        raise ExtractError(f"{name}: the sentence names {sorted(three_digits)}, the table {sorted(table)}")
    return {
        "sources": [source_of(info, "c10", "bytes per parameter of the model states by recipe, with the rule"),
                    source_of(info, "575ba1b9", "optimizer table: state bytes per parameter (2 decimals)"),
                    source_of(info, "6ffc7155", "the same states per parameter, 3 significant digits")],
        "model_states_by_recipe": recipes,
        "optimizer_state_bytes_per_param": {k: {"table": table[k], "sentence": three_digits[k]} for k in table},
    }


def ch07_zero() -> dict:
    """Chapter 7: the ZeRO formula against the paper (section 7.3) and the per-rank bytes measured in the
    launched runs (section 7.4), GPT-NeoX 1.3B, fp32 AdamW."""
    name = "07_distributed_zero.ipynb"
    nb = load(name)
    info = run_info(nb, name)
    paper = {r[""]: {k: v for k, v in r.items() if k} for r in text_table(outputs(cell(nb, name, "c23"), "stream")[0])}
    per_rank = []
    for r in html_table(outputs(cell(nb, name, "c32"), "text/html")[0]):
        ws, strategy = (x.strip() for x in r[""].split("|"))
        row = {"world_size": int(ws), "strategy": strategy}
        for k, v in r.items():
            if k and ("(GiB)" in k or k == "measured / formula"):
                row[k] = number(v)
        per_rank.append(row)
    return {
        "sources": [source_of(info, "c23", "ZeRO formula vs the paper's 7.5B example"),
                    source_of(info, "c32", "per-rank model states measured (FSDP2/ZeRO runs) vs the formula")],
        "paper_7_5b": paper,
        "per_rank": per_rank,
    }


def ch04_checkpoint_every_k() -> dict:
    """Chapter 4, section 4.1: a chain of N layers checkpointed every k (the input of layers 0, k, 2k, ...
    is kept): layer outputs stored at the peak, and layer forwards."""
    name = "04_gradient_checkpointing.ipynb"
    nb = load(name)
    info = run_info(nb, name)
    rows = html_table(outputs(cell(nb, name, "c09"), "text/html")[0])
    every = {}
    for r in rows:
        m = re.fullmatch(r"\(c\) checkpoint every (\d+)", r[""])
        if m:
            every[m.group(1)] = {"stored": number(r["stored (layer outputs)"]), "forwards": number(r["layer forwards"])}
    store_all = next(r for r in rows if r[""].startswith("(a)"))
    return {
        "sources": [source_of(info, "c09", "the chain: stored layer outputs and layer forwards per strategy")],
        "n_layers": int(number(store_all["layer forwards"])),
        "store_everything": number(store_all["stored (layer outputs)"]),
        "checkpoint_every": every,
    }


FIXTURES = {
    "ch10_planner_validation.json": ch10_validation,
    "ch01_bytes.json": ch01_bytes,
    "ch05_optimizer_states.json": ch05_optimizer_states,
    "ch07_zero.json": ch07_zero,
    "ch04_checkpoint_every_k.json": ch04_checkpoint_every_k,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if a fixture would change")
    ap.add_argument("--out", type=Path, default=GOLDEN)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    changed = []
    for fname, build in FIXTURES.items():
        text = json.dumps(build(), indent=1, ensure_ascii=False) + "\n"
        path = args.out / fname
        if not path.exists() or path.read_text() != text:
            changed.append(fname)
            if not args.check:
                path.write_text(text)
    verb = "would change" if args.check else "written"
    print(f"{verb}: {', '.join(changed) if changed else 'nothing'}")
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
