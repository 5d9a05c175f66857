"""The lm-evaluation-harness model ``kdn_jax`` run by the harness itself, offline, on local YAML tasks over
JSONL files: its multiple-choice log-likelihoods, rolling log-likelihoods (documents longer than the
carried chunk) and greedy generations equal the model's own, computed here by one plain forward / the
model's greedy choice by plain forwards; the rolling score equals experiments.evaluate's position-wise NLL on the same text;
docs/lm_eval.md's local-task command runs as written; kdn-lm-eval's errors are one line. Also experiments.load's errors."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

# the harness reads its datasets through HF datasets: local files only, cached under /tmp
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="kdn_hf_datasets_"))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import lm_eval  # pylint: disable=g-import-not-at-top,wrong-import-position  (in the test extra: never skipped)
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax import nnx  # pylint: disable=g-import-not-at-top,wrong-import-position
from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top,wrong-import-position
from runner_helpers import ROOT, one_device_env, train_tiny_lm  # pylint: disable=wrong-import-position

import experiments  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import (
  lm_eval_adapter,  # pylint: disable=g-import-not-at-top,wrong-import-position
  loading,  # pylint: disable=g-import-not-at-top,wrong-import-position
)
from experiments.evaluation import suites  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments.evaluation.runner import evaluate  # pylint: disable=g-import-not-at-top,wrong-import-position

CHOICES = [
  ("The river ran past", ["an old mill", "the miller sang", "grey clouds"], 0),
  ("Boats drifted slowly toward", ["a distant harbor", "stone"], 1),
  ("Children played and", ["the miller sang of grain", "wind"], 0),
  ("", ["Grey clouds.", "Stone."], 1),
]  # an empty context: scored after the prefix token alone
PROMPTS = [
  "The miller sang of",
  "Under grey clouds the river",
  " ".join(["the old mill where children played and boats drifted"] * 4),
]  # > one 32-token chunk


def _yaml(name, path, output_type, extra):
  return (
    f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\n"
    f"test_split: test\noutput_type: {output_type}\n{extra}"
  )


def _write_task(d, name, rows, output_type, extra):
  path = os.path.join(d, f"{name}.jsonl")
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  with open(os.path.join(d, f"{name}.yaml"), "w", encoding="utf-8") as f:
    f.write(_yaml(name, path, output_type, extra))


PAD = 256  # every direct forward runs at this length (right-padded: a causal model's positions never see
# what comes after them), so the oracle compiles once


def _forward(model):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)[0])


def _log_probs(fwd, state, ids):
  """log p(ids[t] | ids[:t]) for t >= 1 and whether ids[t] is the argmax, by one forward over the whole
  sequence (no chunks, no cache, one row)."""
  ids = np.asarray(ids)
  x = np.zeros((1, PAD), np.int32)
  x[0, : len(ids) - 1] = ids[:-1]
  logits = np.asarray(fwd(state, x))[0, : len(ids) - 1].astype(np.float64)
  lp = logits - logits.max(-1, keepdims=True)
  lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
  return lp[np.arange(len(ids) - 1), ids[1:]], np.argmax(logits, -1) == ids[1:]


def _greedy(fwd, state, ids, n, eos):
  """n greedy tokens after ids, each from a full forward over everything so far (stops at eos)."""
  ids, out = list(ids), []
  for _ in range(n):
    x = np.zeros((1, PAD), np.int32)
    x[0, : len(ids)] = ids
    nxt = int(np.argmax(np.asarray(fwd(state, x))[0, len(ids) - 1]))
    if nxt == eos:
      break
    ids.append(nxt)
    out.append(nxt)
  return out


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
  base = tmp_path_factory.mktemp("lm_eval")
  workdir, cdir = train_tiny_lm(base, num_steps=2)
  run = experiments.load(workdir)
  tok, eos = run.tokenizer, run.tokenizer.eos_id
  fwd, state = _forward(run.model), nnx.state(run.model)
  long_docs = [
    " ".join(
      np.random.default_rng(i).choice(
        "the river ran past an old mill where children played".split(), 60
      )
    )
    + "."
    for i in range(3)
  ]
  # the generation task's answers: the model's own greedy text for the first prompt, another for the rest,
  # so exact match is 1/3 exactly when the harness generated what the model generates
  gens = []
  for p in PROMPTS:
    text = tok.decode(_greedy(fwd, state, [eos] + tok.encode(p).tolist(), 6, eos))
    gens.append(text[: text.index(".")] if "." in text else text)
  tasks = str(base / "tasks")
  os.makedirs(tasks)
  _write_task(
    tasks,
    "kdn_mc",
    [{"q": q, "choices": c, "label": y} for q, c, y in CHOICES],
    "multiple_choice",
    'doc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
    "metric_list:\n  - metric: acc\n",
  )
  _write_task(
    tasks,
    "kdn_rolling",
    [{"text": t} for t in long_docs],
    "loglikelihood_rolling",
    'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
    "  - metric: bits_per_byte\n",
  )
  _write_task(
    tasks,
    "kdn_gen",
    [
      {"prompt": p, "answer": g if i == 0 else g + " not this"}
      for i, (p, g) in enumerate(zip(PROMPTS, gens))
    ],
    "generate_until",
    'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'
    'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 6\nmetric_list:\n  - metric: exact_match\n',
  )
  return {
    "workdir": workdir,
    "corpus": cdir,
    "run": run,
    "fwd": fwd,
    "state": state,
    "tasks": tasks,
    "long_docs": long_docs,
    "gens": gens,
  }


@pytest.fixture(scope="module")
def harness(lm):
  tm = TaskManager(include_path=lm["tasks"], include_defaults=False)
  return lm_eval.simple_evaluate(
    model="kdn_jax",
    model_args={"workdir": lm["workdir"]},
    tasks=["kdn_mc", "kdn_rolling", "kdn_gen"],
    task_manager=tm,
    batch_size=2,
    device="cpu",
    log_samples=True,
  )


def test_multiple_choice_equals_direct_loglikelihoods(lm, harness):
  tok = lm["run"].tokenizer
  accs = []
  for sample in harness["samples"]["kdn_mc"]:
    lls = []
    for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
      ctx = tok.encode(context).tolist() if context else []
      whole = tok.encode(context + continuation).tolist()
      assert whole[: len(ctx)] == ctx  # the texts split cleanly at the boundary
      lp, greedy = _log_probs(lm["fwd"], lm["state"], [tok.eos_id] + whole)
      n = len(whole) - len(ctx)
      want = float(lp[-n:].sum())
      assert resp[0][0] == pytest.approx(want, abs=2e-4 * n), (context, continuation)
      assert resp[0][1] == bool(greedy[-n:].all())
      lls.append(want)
    accs.append(float(np.argmax(lls) == sample["doc"]["label"]))
  assert len(accs) == len(CHOICES)
  assert harness["results"]["kdn_mc"]["acc,none"] == pytest.approx(np.mean(accs))


def test_rolling_equals_direct_and_is_chunked(lm, harness):
  tok = lm["run"].tokenizer
  total_ll, words, nbytes = 0.0, 0, 0
  for sample in harness["samples"]["kdn_rolling"]:
    text = sample["doc"]["text"]
    ids = [tok.eos_id] + tok.encode(text).tolist()
    assert (
      len(ids) > 2 * 32
    )  # longer than the training length: the adapter carries state over chunks
    want = float(_log_probs(lm["fwd"], lm["state"], ids)[0].sum())
    assert sample["resps"][0][0] == pytest.approx(want, rel=1e-5, abs=1e-3)
    total_ll += want
    words += len(re.split(r"\s+", text))
    nbytes += len(text.encode())
  res = harness["results"]["kdn_rolling"]
  assert res["word_perplexity,none"] == pytest.approx(np.exp(-total_ll / words), rel=1e-4)
  assert res["bits_per_byte,none"] == pytest.approx(-total_ll / nbytes / np.log(2), rel=1e-4)


def test_generation_equals_the_models_greedy_generate(lm, harness):
  got = {s["doc"]["prompt"]: s["resps"][0][0] for s in harness["samples"]["kdn_gen"]}
  assert [got[p] for p in PROMPTS] == lm["gens"]
  assert harness["results"]["kdn_gen"]["exact_match,none"] == pytest.approx(1 / 3)


def test_rolling_equals_evaluate_position_ppl(lm, harness, tmp_path):
  """experiments.evaluate's position-wise NLL over a long-eval file holding the text as one document."""
  tok = lm["run"].tokenizer
  sample = harness["samples"]["kdn_rolling"][0]
  ids = tok.encode(sample["doc"]["text"])
  path = str(tmp_path / "one_doc.npy")
  np.save(path, np.append(ids, tok.eos_id).astype(np.int32))
  s = suites.Settings(max_len=len(ids), chunk=32, num_sequences=1, long_eval_path=path)
  evaluate(lm["workdir"], ["position_ppl"], s, out_dir=str(tmp_path / "eval"))
  per_pos = np.load(tmp_path / "eval" / "position_nll.npy")
  assert per_pos.shape == (len(ids),)
  assert sample["resps"][0][0] == pytest.approx(
    -float(per_pos.sum(dtype=np.float64)), rel=1e-5, abs=1e-3
  )


def _documented_command():
  """The command of docs/lm_eval.md's local-task example: (environment assignments, argv)."""
  with open(os.path.join(ROOT, "docs", "lm_eval.md"), encoding="utf-8") as f:
    text = f.read()
  block = re.search(r"<!-- lm-eval-doc-test:[^\n]*-->\n```bash\n(.+?)\n```", text, re.S)
  assert block, "docs/lm_eval.md lost its tested example"
  words = shlex.split(block[1])
  env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
  return env, [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]


def test_documented_local_task_command_runs(lm):
  """docs/lm_eval.md's command, as written (lm_eval's default device, cuda:0, on a CPU-only machine),
  on the tiny run: lm_eval's table for the shipped tasks, results in a folder named after the run."""
  env, argv = _documented_command()
  assert env == {"HF_DATASETS_OFFLINE": "1"} and argv[:2] == ["python", "-m"]
  argv = [sys.executable] + [w.replace("/tmp/lm", lm["workdir"]) for w in argv[1:]]
  out = subprocess.run(
    argv,
    cwd=ROOT,
    env={**one_device_env(), **env, "HF_DATASETS_CACHE": os.environ["HF_DATASETS_CACHE"]},
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  for task, metric in (("kdn_example_mc", "acc"), ("kdn_example_ppl", "bits_per_byte")):
    assert re.search(rf"\|\s*{task}\s*\|.*\|\s*{metric}\s*\|", out.stdout), out.stdout[-2000:]
  if not any(d.platform == "gpu" for d in jax.devices()):
    warned = [l for l in out.stderr.splitlines() if "JAX has no GPU here" in l]
    assert len(warned) == 1 and "running on the CPU" in warned[0]
  results = os.listdir(os.path.join(lm["workdir"], "eval", "lm_eval", "run"))
  assert len(results) == 1 and results[0].startswith("results_"), results


def test_cuda_without_a_gpu_is_the_cpu_with_one_warning(caplog):
  if any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("needs a machine without a GPU")
  with caplog.at_level("WARNING"):
    assert lm_eval_adapter.jax_device("cuda:0").platform == "cpu"
  assert [r.getMessage() for r in caplog.records] == [
    "kdn_jax: device 'cuda:0': JAX has no GPU here; running on the CPU"
  ]
  with pytest.raises(lm_eval_adapter.SetupError, match="device: 'tpu': JAX has no tpu backend"):
    lm_eval_adapter.jax_device("tpu")


def test_run_name():
  assert lm_eval_adapter.run_name("/tmp/lm") == "lm"
  assert lm_eval_adapter.run_name("/tmp/lm/", 300) == "lm_step300"
  assert lm_eval_adapter.run_name("/tmp/lm/checkpoints/300") == "lm_step300"


def test_command_line_bad_model_args_is_one_line(lm, monkeypatch, capsys):
  """kdn-lm-eval's own main, in this process: exit code 2 and one stderr line naming the argument."""
  tasks = os.path.join(ROOT, "docs", "lm_eval")
  for args, line in (
    (
      "work_dir=/tmp/lm",
      r"model_args: unknown \['work_dir'\] \(work_dir: did you mean workdir\?\)",
    ),
    (
      f"workdir={lm['workdir']},step=999",
      r"model_args: step: no checkpoint for step 999 .*have \[2\]",
    ),
  ):
    argv = ["kdn-lm-eval", "--model", "kdn_jax", "--model_args", args, "--tasks", "kdn_example_mc"]
    monkeypatch.setattr(sys, "argv", argv + ["--include_path", tasks, "--device", "cpu"])
    with pytest.raises(SystemExit) as e:
      lm_eval_adapter.main()
    assert e.value.code == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("kdn-lm-eval:")]
    assert len(err) == 1 and re.match(rf"kdn-lm-eval: {line}", err[0]), err


def test_bad_model_args_name_the_argument(lm, tmp_path):
  bad = lm_eval_adapter.SetupError
  with pytest.raises(bad, match="model_args: workdir=<run directory or checkpoint> is required"):
    lm_eval_adapter.KdnJaxLM()
  with pytest.raises(bad, match=r"model_args: unknown \['pretrained'\]; expected workdir"):
    lm_eval_adapter.KdnJaxLM(workdir=lm["workdir"], pretrained="gpt2")
  with pytest.raises(bad, match="device: expected cpu, gpu, cuda or tpu"):
    lm_eval_adapter.KdnJaxLM(workdir=lm["workdir"], device="mps")
  with pytest.raises(bad, match="batch_size: expected a positive integer or auto"):
    lm_eval_adapter.KdnJaxLM(workdir=lm["workdir"], batch_size="0")
  with pytest.raises(bad, match="model_args: tokenizer: .* does not exist"):
    lm_eval_adapter.KdnJaxLM(workdir=lm["workdir"], tokenizer=str(tmp_path / "none.json"))
  with pytest.raises(bad, match=r"model_args: workdir: no such directory"):
    lm_eval_adapter.KdnJaxLM(workdir=str(tmp_path / "nope"))


def test_load_returns_model_config_tokenizer_and_names_bad_input(lm, tmp_path, monkeypatch):
  ckpt = os.path.join(lm["workdir"], "checkpoints", "2")
  run = loading.load(ckpt)  # one step directory
  assert run.step == 2 and run.workdir == lm["workdir"] and run.config.data.seq_len == 32
  assert run.tokenizer.decode(run.tokenizer.encode("The river.")) == "The river."
  with pytest.raises(FileNotFoundError, match=r"step: no checkpoint for step 9 .*\(have \[2\]\)"):
    loading.load(lm["workdir"], step=9)
  with pytest.raises(ValueError, match="step: 1 differs from the step directory"):
    loading.load(ckpt, step=1)
  with pytest.raises(ValueError, match="step: expected an integer or None, got 'last'"):
    loading.load(lm["workdir"], step="last")
  with pytest.raises(FileNotFoundError, match="workdir: no such directory"):
    loading.load(str(tmp_path / "nope"))
  # a checkpoint whose config builds another model: named before any array is read
  real = loading._config_from  # pylint: disable=protected-access

  def wider(record, workdir):
    cfg = real(record, workdir)
    cfg.model.d_model = 48
    return cfg

  monkeypatch.setattr(loading, "_config_from", wider)
  with pytest.raises(
    ValueError, match="workdir: checkpoint .* does not fit this model .*builds a different model"
  ):
    loading.load(lm["workdir"])
  monkeypatch.undo()
  synthetic = loading.LoadedRun(
    "w", run.config.copy_and_resolve_references(), run.model, 2, ckpt, None
  )
  synthetic.config.data.kind = "mqar"
  with pytest.raises(ValueError, match="tokenizer: the run trained on 'mqar' data"):
    _ = synthetic.tokenizer
