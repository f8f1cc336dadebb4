"""The ``dualop`` command's edges, as a new user meets them: filter names refused in one line with
what the flag takes and a did-you-mean, filters that select nothing refused, a bad ``DUALOP_*``
variable reported in one line, refusals without a traceback but bugs with one, an honest ``dualop
ops`` table, ``report``'s progress bar, ``generate``'s messages and the CPU kernels' build notice."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dualop import check, cli


def _refused(capsys, argv: list[str]) -> str:
    """Run ``dualop ARGV`` in-process; it must exit 2 with one line on stderr and nothing run."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "passed" not in captured.out and "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


# --- filter names ------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "flag", "bad", "meant"), [
    (["check", "--frontends", "pytorch"], "--frontends", "pytorch", "torch"),
    (["check", "--platforms", "gpu"], "--platforms", "gpu", "cuda"),
    (["check", "--dtypes", "bf16"], "--dtypes", "bf16", "bfloat16"),
    (["check", "--ops", "rms_nrom"], "--ops", "rms_nrom", "rms_norm"),
    (["check", "--list", "--frontends", "jaxx"], "--frontends", "jaxx", "jax"),
    (["check", "--fuzz", "--paths", "tpu"], "--paths", "tpu", "pallas"),
    (["check", "--fuzz", "--ops", "rms_nrom"], "--ops", "rms_nrom", "rms_norm"),
    (["report", "--frontends", "pytorch"], "--frontends", "pytorch", "torch"),
    (["report", "--ops", "sillu_and_mul"], "--ops", "sillu_and_mul", "silu_and_mul"),
    (["compile", "--list", "--dtypes", "fp16"], "--dtypes", "fp16", "float16"),
    (["compile", "--list", "--ops", "rms_nrom"], "--ops", "rms_nrom", "rms_norm"),
    (["bench", "--list", "--frontends", "pytorch"], "--frontends", "pytorch", "torch"),
    (["bench", "--list", "--dtypes", "bf16"], "--dtypes", "bf16", "bfloat16"),
    (["bench", "--list", "--ops", "rms_nrom"], "--ops", "rms_nrom", "rms_norm"),
])
def test_an_unknown_filter_name_is_refused_with_what_it_meant(capsys, argv, flag, bad, meant):
    line = _refused(capsys, [*argv, "--no-progress"])
    command = argv[0]
    assert line.startswith(f"dualop {command}: {flag}: {bad!r} (did you mean {meant!r}?)"), line
    assert f"dualop {command}: dualop" not in line  # one prefix, never "dualop check: dualop check: ..."
    assert "accepted: " in line


def test_a_case_label_with_commas_is_one_name():
    """Commas inside a label's brackets belong to it: only the ones between names split."""
    from dualop.cli_names import split_names

    label = "ragged_paged_attention[gqa4,window,soft_cap,mask_value,sinks]"
    assert split_names("--ops", f"rms_norm, {label},silu_and_mul") == ["rms_norm", label, "silu_and_mul"]
    assert split_names("--ops", "a[x,y],b[z]") == ["a[x,y]", "b[z]"]
    assert split_names("--ops", "a],b") == ["a]", "b"]  # a stray bracket cannot swallow the rest


def test_the_accepted_names_are_listed_or_pointed_to(capsys):
    line = _refused(capsys, ["check", "--frontends", "pytorch", "--no-progress"])
    assert line.endswith("accepted: torch, jax, torch_xla, torchax")
    line = _refused(capsys, ["check", "--ops", "rms_nrom", "--no-progress"])
    assert "silu_and_mul" not in line  # not every registered op, but where they are listed
    assert "listed by `dualop ops`" in line


def test_filters_that_select_nothing_are_refused(capsys):
    line = _refused(capsys, ["check", "--frontends", "jax", "--platforms", "rocm", "--no-progress"])
    assert "select no cell" in line and "jax/cpu" in line  # names the cells there are
    line = _refused(capsys, ["check", "--ops", "parallel_lm_head", "--no-progress"])
    assert "'parallel_lm_head' has no check case" in line
    line = _refused(capsys, ["report", "--ops", ",", "--no-progress"])
    assert "--ops ',' names nothing" in line


def test_a_filtered_check_names_no_unrelated_ops(capsys):
    """The note on ops with no check case belongs to a run over every op, not one over --ops."""
    from dualop import testing

    def results(ops):
        return [check.CellResult(c.op, c.label, "torch", "cpu", "float32", "pass", "forward_cpu", "torch cpu")
                for c in testing.cases_for(ops)]

    assert check.registered_without_case()  # (else there would be nothing to name)
    assert "no check case" not in check.format_table(results(["rms_norm"]))
    assert "registered ops with no check case" in check.format_table(results(None))


# --- errors: refusals in one line, bugs with their traceback ------------------------------------

def test_a_bad_custom_ops_variable_is_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUALOP_")}
    proc = subprocess.run([sys.executable, "-m", "dualop.cli", "check", "--list", "--ops", "rms_norm"],
                          env={**env, "DUALOP_CUSTOM_OPS": "al"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.strip() == ("dualop check: DUALOP_CUSTOM_OPS='al': entry 'al' is not one of 'all', 'none', "
                                   "'+<op name>', '-<op name>'; did you mean 'all'?")


def test_custom_ops_entries_get_a_did_you_mean():
    from dualop.config import OpsConfig, config_from_env

    with pytest.raises(ValueError, match=r"'rms_norm' is not one of .*; did you mean '\+rms_norm' \(enable it\)"):
        OpsConfig(["rms_norm"])
    with pytest.raises(ValueError, match=r"^DUALOP_CUSTOM_OPS='nne,\+rms_norm': entry 'nne' .*did you mean 'none'"):
        config_from_env({"DUALOP_CUSTOM_OPS": "nne,+rms_norm"})
    with pytest.raises(ValueError, match=r"^DUALOP_MODE='7' is not a compilation mode"):
        config_from_env({"DUALOP_MODE": "7"})


def test_dualops_own_type_error_is_one_line_but_a_bug_keeps_its_traceback(monkeypatch, capsys):
    from dualop import cli_names
    from dualop.config import OpsConfig

    monkeypatch.setattr(cli, "cmd_ops", lambda args: OpsConfig("none,+rms_norm"))  # dualop refuses: a TypeError
    line = _refused(capsys, ["ops"])
    assert line.startswith("dualop ops: OpsConfig: custom_ops must be a list of strings")
    # A TypeError Python raises inside dualop's code (not a raise of dualop's) is a bug: traceback.
    monkeypatch.setattr(cli, "cmd_ops", lambda args: cli_names.check_names("--ops", ["x"], None, "op"))
    with pytest.raises(TypeError, match="not iterable"):
        cli.main(["ops"])
    monkeypatch.setattr(cli, "cmd_ops", lambda args: 1 / 0)  # any other exception too
    with pytest.raises(ZeroDivisionError):
        cli.main(["ops"])


# --- dualop ops: what each op really implements -------------------------------------------------

def test_ops_shows_only_the_methods_an_op_really_implements(capsys):
    assert cli.main(["ops", "--json"]) == 0
    rows = {r["op"]: r["implements"] for r in json.loads(capsys.readouterr().out)}
    assert rows["rms_norm"] == "native,cpu,cuda,tpu"
    assert rows["xielu"] == "native,cuda,tpu"  # forward_cpu is inherited and declined for every instance
    assert rows["parallel_lm_head"] == "no forward"


def test_implemented_methods_rule():
    from dualop.custom_op import CustomOp
    from dualop.reference import implemented_methods

    class Refusing(CustomOp):
        def forward_native(self, x):
            return x

        def forward_cpu(self, x):
            """Only refuses."""
            raise NotImplementedError("no CPU kernel")

        def forward_tpu(self, x):
            return x

    class AlwaysDeclines(Refusing):
        def forward_cuda(self, x):
            return x

        def declines(self, method, frontend):
            return "never here" if method == "forward_cuda" else None

    class DeclinesBySetting(AlwaysDeclines):
        def declines(self, method, frontend):
            return self.why  # set by a constructor: some instances take forward_cuda

    class NoForward(Refusing):
        def forward_native(self, x):
            raise RuntimeError("no forward")

    assert implemented_methods(Refusing) == ("forward_native", "forward_tpu")
    assert implemented_methods(AlwaysDeclines) == ("forward_native", "forward_tpu")
    assert implemented_methods(DeclinesBySetting) == ("forward_native", "forward_cuda", "forward_tpu")
    assert implemented_methods(NoForward) == ()


def test_the_reference_page_says_the_same():
    from dualop.custom_op import CustomOp
    from dualop.reference import _op_section

    xielu = "\n".join(_op_section("xielu", CustomOp.op_registry["xielu"]))
    assert "Implements: `forward_native`, `forward_cuda`, `forward_tpu`." in xielu
    head = "\n".join(_op_section("parallel_lm_head", CustomOp.op_registry["parallel_lm_head"]))
    assert "No forward:" in head and "Implements:" not in head


# --- dualop report's progress bar ----------------------------------------------------------------

def test_report_draws_a_progress_bar_unless_told_not_to(capsys):
    argv = ["report", "--ops", "rms_norm", "--frontends", "torch", "--no-run", "--json"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "dualop report" in captured.err and "cell" in captured.err
    assert json.loads(captured.out)  # the bar is on stderr: stdout stays the JSON
    assert cli.main([*argv, "--no-progress"]) == 0
    assert "dualop report" not in capsys.readouterr().err


# --- dualop generate's messages ------------------------------------------------------------------

def test_generate_names_its_own_flags_for_a_prompt_too_long(capsys, tmp_path):
    # Checked before the checkpoint is read: the directory need not hold one.
    line = _refused(capsys, ["generate", str(tmp_path), "--prompt", " ".join(["1"] * 10), "--max-model-len", "12"])
    assert line == ("dualop generate: --prompt 0 has 10 tokens; with --max-new-tokens=16 that exceeds "
                    "--max-model-len=12 (the KV cache's length per sequence); pass a larger --max-model-len")


def test_generate_introduces_the_model_once_and_notes_compiles_only_for_jax(capsys, tmp_path):
    transformers = pytest.importorskip("transformers", reason="writes the tiny checkpoint")
    torch = pytest.importorskip("torch", reason="the torch frontend")

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert cli.main(["generate", str(tmp_path), "--max-new-tokens", "2", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert header.startswith("model LlamaForCausalLM, frontend torch, float32, tp 1, ")
    assert header.count("LlamaForCausalLM") == 1
    assert "compiling" not in out and "\nsteps:\n" in out


# --- the CPU kernels' build notice ---------------------------------------------------------------

def test_the_cpu_kernel_build_says_so_once(monkeypatch, tmp_path, capsys):
    """A build prints the notice on stderr; loading the built library again prints nothing. (A tiny
    stand-in source keeps the build short; the path through load() is the real one.)"""
    from dualop.kernels import cpu

    compiler = cpu._compiler()
    if compiler is None:
        pytest.skip("no C++ compiler here: load() raises KernelUnavailable before any build")
    source = tmp_path / "tiny.cc"
    source.write_text('extern "C" int dualop_tiny() { return 1; }\n')
    monkeypatch.setenv("DUALOP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu, "compile_command",
                        lambda compiler, sources, header, out: [compiler, "-shared", "-fPIC", str(source), "-o", str(out)])
    for first in (True, False):
        monkeypatch.setattr(cpu, "_library", None)
        monkeypatch.setattr(cpu, "_failure", None)
        assert cpu.load().dualop_tiny() == 1
        err = capsys.readouterr().err
        assert (cpu.BUILD_MESSAGE in err) == first, err
