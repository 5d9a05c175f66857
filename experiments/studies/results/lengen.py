"""RESULTS.md: length generalisation (second paper) and S-NIAH on the same LMs, from docs/results/lengen/."""

from __future__ import annotations

import os

import numpy as np

from experiments.studies.results.common import exists, load, plt, save, table

MIXERS = ("kdn_diag", "kda", "gla", "mamba2")
STRATEGIES = ("pretrain", "zero", "random_noise", "fitted_noise", "state_passing", "tbtt")
FAIL_RATIO = 1.5  # PPL@16k / PPL@512 above this counts as failing past the training length
UNTESTABLE = 0.05  # S-NIAH: a best exact match below this means no mixer does the task at all
LABEL = {
  "pretrain": "pretrained (zero, 2000 steps)",
  "zero": "+300 zero",
  "random_noise": "+300 random noise",
  "fitted_noise": "+300 fitted noise",
  "state_passing": "+300 state passing",
  "tbtt": "+300 TBTT",
}


def _runs(root):
  out = {}
  for m in MIXERS:
    for s in STRATEGIES:
      d = os.path.join(root, m, s, "eval")
      if exists(d, "position_ppl.json"):
        out[(m, s)] = {
          k: load(os.path.join(d, f"{k}.json"))
          for k in ("ppl", "position_ppl", "effrem", "beta_eff", "retrieval")
          if exists(d, f"{k}.json")
        }
  return out


def _figure(mixer, runs, fig_dir):
  p = plt()
  fig, (a1, a2) = p.subplots(1, 2, figsize=(11, 4))
  for s in STRATEGIES:
    r = runs.get((mixer, s))
    if not r:
      continue
    pp, er = r["position_ppl"], r["effrem"]
    a1.plot(pp["bucket_center"], pp["bucket_ppl"], label=LABEL[s], lw=1.2)
    a2.plot(er["t"], er["mean"], "o-", ms=3, label=LABEL[s], lw=1.2)
  any_run = next(v for (m, _), v in runs.items() if m == mixer)
  train_len = any_run["position_ppl"]["train_len"]
  a1.axvline(train_len, color="k", ls="--", lw=1)
  a1.set(
    xscale="log",
    yscale="log",
    xlabel="position t",
    ylabel="PPL(t) on long-eval documents",
    title=f"{mixer}: position-wise perplexity (training length {train_len} dashed)",
  )
  T = any_run["effrem"]["T"]
  a2.axvline(T - train_len, color="k", ls="--", lw=1)
  a2.set(
    xlabel="prefix cut t",
    ylabel=r"EffRem$_T$(t)",
    ylim=(0, 1),
    title=f"{mixer}: Effective Remembrance, T = {T}",
  )
  for a in (a1, a2):
    a.grid(alpha=0.3, which="both")
  a2.legend(fontsize=7)
  return save(fig, fig_dir, f"lengen_{mixer}.png")


def render(results_dir: str, fig_dir: str) -> str:
  root = os.path.join(results_dir, "lengen")
  if not exists(root):
    return ""
  runs = _runs(root)
  cmds = load(os.path.join(root, "commands.json"))
  mixers = [m for m in MIXERS if any(k[0] == m for k in runs)]
  out = [
    "## 3. Length generalisation (second paper): interventions on the initial state",
    "",
    f"Machine: {cmds['machine']}. Corpus: `{cmds['corpus']}`.",
    "",
    "```",
    cmds["script"],
    "# which runs, per mixer:",
    cmds["pretrain"],
    cmds["post"],
    cmds["evaluate"],
    "```",
    "",
    "Each mixer (~30M parameters, `configs/lm_corpus.py`, 6 layers, d=512, 4 heads of 128, MLP width "
    "matched) is pretrained for 2000 steps of 32 x 512 tokens from the zero state, then post-trained for 300 "
    "steps (fresh optimizer, lr 5e-4) with each intervention; `zero` is the same post-training without one, "
    "the control. Validation perplexity is on the held-out documents (packed, T=512); PPL(t) is on the "
    "long-eval documents (Austen, Shakespeare, three held-out Bible books; 8 windows of 16384 tokens, state "
    "carried in chunks of 512), `PPL@n` = exp(mean NLL over positions [n/2, n)). Evaluation always starts "
    "from the normal initial state.",
    "",
  ]
  rows = []
  for m in mixers:
    for s in STRATEGIES:
      r = runs.get((m, s))
      if not r:
        continue
      at = r["position_ppl"]["ppl_at"]
      er = r["effrem"]
      t_half = er["t"].index(min(er["t"], key=lambda t: abs(t - er["T"] // 2)))
      rows.append(
        [
          m,
          LABEL[s],
          r["ppl"]["perplexity"],
          at["512"],
          at["2048"],
          at["16384"],
          at["16384"] / at["512"],
          er["mean"][t_half],
          er["mean"][-1],
        ]
      )
  out += [
    table(
      [
        "mixer",
        "run",
        "val PPL",
        "PPL@512",
        "PPL@2k",
        "PPL@16k",
        "PPL@16k / PPL@512",
        "EffRem(T/2)",
        "EffRem(T-1)",
      ],
      rows,
    ),
    "",
  ]
  for m in mixers:
    out += [f"![{m}]({_figure(m, runs, fig_dir)})", ""]

  ratios = {(r[0], r[1]): r[6] for r in rows}
  zero_ratio = [ratios[(m, LABEL["pretrain"])] for m in mixers if (m, LABEL["pretrain"]) in ratios]
  helped = []
  for m in mixers:
    base = ratios.get((m, LABEL["zero"]))
    for s in ("state_passing", "tbtt", "random_noise", "fitted_noise"):
      v = ratios.get((m, LABEL[s]))
      if base is not None and v is not None and v < base - 0.01:
        helped.append(f"{m}/{s} ({v:.3f} vs {base:.3f})")
  worst = max(r[6] for r in rows)
  max_half = max(r[7] for r in rows)
  val = {(r[0], r[1]): r[2] for r in rows}
  val_delta = ", ".join(
    f"{m} SP {val[(m, LABEL['state_passing'])] - val[(m, LABEL['zero'])]:+.2f}, "
    f"TBTT {val[(m, LABEL['tbtt'])] - val[(m, LABEL['zero'])]:+.2f}"
    for m in mixers
    if all((m, LABEL[k]) in val for k in ("zero", "state_passing", "tbtt"))
  )
  out += [
    "**What the paper reports and what we see.** The paper finds that zero-initialised recurrent models "
    "fail past their training length (PPL(t) rises sharply after T) and that post-training a few hundred "
    "steps with State Passing or TBTT fixes it, fitted noise only at some sizes.",
    (
      "- *Not reproduced at this scale:* the zero-initialised pretrained models do not fail: "
      if max(zero_ratio) < FAIL_RATIO
      else "- *Reproduced:* the zero-initialised pretrained models degrade: "
    )
    + f"PPL@16k / PPL@512 is {', '.join(f'{v:.3f}' for v in zero_ratio)} ({', '.join(mixers)}), and at most "
    f"{worst:.3f} over every run (we would call a ratio above {FAIL_RATIO} a failure). "
    "The post-training differences: "
    + (
      f"the ratio improved over the zero control for {', '.join(helped)}."
      if helped
      else "no intervention lowered PPL@16k / PPL@512 below the zero control by more than 0.01."
    ),
    f"- *Why we think so:* these models are small and short-trained (30M parameters, 33M tokens, against "
    f"the paper's 125M-1.3B), and their state is short-lived: EffRem(T/2) is at most {max_half:.3f} over "
    f"every run (the prediction at T barely depends on tokens more than T/2 back), so the state likely "
    f"never reaches the out-of-distribution regime that breaks the paper's models. The protocol, "
    f"interventions and diagnostics are in place to rerun at the paper's sizes (`configs/lm_corpus.py`, "
    f"`experiments/studies/length_generalisation.sh`).",
    f"- Validation perplexity (T=512, zero start) after State Passing / TBTT post-training minus after the "
    f"zero control: {val_delta}. Those runs train from carried states but are validated from the zero "
    f"state, so a small rise is expected.",
    "",
  ]

  return "\n".join(out)


def render_sniah(results_dir: str, fig_dir: str) -> str:
  """Section 5: S-NIAH-1/2/3 on the pretrained LMs of section 3."""
  del fig_dir
  root = os.path.join(results_dir, "lengen")
  if not exists(root):
    return ""
  runs = _runs(root)
  mixers = [m for m in MIXERS if any(k[0] == m for k in runs)]
  out = []
  sn_rows = []
  for m in mixers:
    r = runs.get((m, "pretrain"), {}).get("retrieval")
    if not r:
      continue
    for task, cells in r["tasks"].items():
      by_len = {}
      for c in cells:
        by_len.setdefault(c["length"], []).append((c["exact_match"], c["token_accuracy"]))
      for n, v in sorted(by_len.items()):
        sn_rows.append(
          [
            m,
            task,
            n,
            float(np.mean([a for a, _ in v])),
            float(np.mean([b for _, b in v])),
            len(v) * r["examples_per_cell"],
          ]
        )
  if sn_rows:
    best = max(r[3] for r in sn_rows)
    out += [
      "## 5. S-NIAH-1/2/3 on the LMs of section 3 (pretrained checkpoints)",
      "",
      "`python -m experiments.evaluate --workdir=<pretrain run> --suite=retrieval` (RULER-style single "
      "needle; 5 depths per length, 16 examples per cell; teacher-forced: exact match = every answer token "
      "argmax-correct).",
      "",
      table(
        ["mixer", "task", "length", "exact match", "answer-token accuracy", "examples"], sn_rows
      ),
      "",
      ("**Untestable at this size:**" if best < UNTESTABLE else "**Not compared here:**")
      + " the paper reports diagonal KDN ahead of KDA on S-NIAH (+8.2 points at 750M, "
      f"+12.2 at 1.3B); at 30M / 33M tokens the best cell scores {best:.2f} exact match, so "
      + (
        "no mixer solves the task and the comparison cannot be made (the models would need to be "
        "far larger or trained on retrieval-like data)."
        if best < UNTESTABLE
        else "a comparison would need the paper's scale; this table is descriptive only."
      ),
      "",
    ]
  return "\n".join(out)
