"""The `alibi-vit` command's error handling, help, and loading of exported students."""

import fractions
import subprocess
import sys

import pytest
import torch

import alibi_vit
from alibi_vit.cli.main import format_error, main

NAME = "alibi_vit_small_patch14_reg4_dinov2"
TINY = {"depth": 2, "embed_dim": 48, "num_heads": 2}
TINY_ARGS = ["--model-arg", "depth=2", "--model-arg", "embed_dim=48", "--model-arg", "num_heads=2"]


def run_probe(tmp_path, *extra):
    return main(["probe", "--model", NAME, "--images", "noise", "--noise-count", "2", "--repeats", "1",
                 "--out", str(tmp_path / "probe.csv"), *extra])


def error_of(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize("extra, expected", [
    (["--size", "50", *TINY_ARGS], "--size 50 is not a multiple of the patch size 14 px; use e.g. 42 or 56"),
    (["--model-arg", "depth"], "--model-arg expects KEY=VALUE"),
    (["--model-arg", "=2"], "--model-arg expects KEY=VALUE"),
    (["--size", "28", "--model-arg", "no_such_option=1"], "unexpected keyword argument 'no_such_option'"),
    (["--size", "28", "--model-arg", "embed_dim=50"], "cannot build alibi_vit_small_patch14_reg4_dinov2 with "
                                                       "embed_dim=50"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, extra, expected):
    assert run_probe(tmp_path, *extra) == 2
    assert expected in error_of(capsys)


def test_unknown_model_names_close_matches_before_building_anything(tmp_path, capsys):
    code = main(["probe", "--model", "vit_small_patch14_reg4_dinov2", "alibi_vit_smal_patch14_reg4_dinov2",
                 "--images", "noise", "--out", str(tmp_path / "x.csv")])
    assert code == 2
    captured = capsys.readouterr()
    assert "did you mean alibi_vit_small_patch14_reg4_dinov2" in captured.err
    assert "randomly initialised" not in captured.err  # failed before the first (valid) model was built
    with pytest.raises(ValueError, match="unknown model 'xyzzy'; this project's are"):
        alibi_vit.create_backbone("xyzzy")
    # a name cut short: the names it begins are offered first, not unrelated close spellings
    with pytest.raises(ValueError, match="did you mean alibi_vit_small_patch14_reg4_dinov2, alibi_vit_small_patch16"):
        alibi_vit.create_backbone("alibi_vit_smal")


def test_corrupt_checkpoints_never_pass_on_torch_advice(tmp_path, capsys):
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    truncated = tmp_path / "truncated.pth"
    torch.save({"w": torch.zeros(100)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    for path in (junk, truncated):
        assert run_probe(tmp_path, "--checkpoint", str(path), *TINY_ARGS, "--size", "28") == 2
        line = error_of(capsys)
        assert f"cannot read checkpoint {path}: the file is corrupted, truncated or not a PyTorch checkpoint" in line
        assert "weights_only" not in line

    # A pickled object: torch's safe loader refuses it (and would suggest weights_only=False).
    pickled = tmp_path / "object.pth"
    torch.save({"w": fractions.Fraction(1, 3)}, pickled)
    with pytest.raises(ValueError, match=r"pickled Python objects besides tensors \(e.g. fractions.Fraction\)") as err:
        alibi_vit.load_state_dict_file(pickled)
    assert "weights_only" not in str(err.value)


def exported_demo_student(tmp_path):
    """A tiny student in the release format, written by `alibi-vit export` from a Lightning-style checkpoint."""
    from lit_modules.distillation import build_student

    torch.manual_seed(0)
    student = build_student(NAME, TINY, {"backend": "sdpa"}).eval()
    ckpt = tmp_path / "demo.ckpt"
    torch.save({"state_dict": {f"student.{k}": v for k, v in student.state_dict().items()}, "global_step": 3,
                "hyper_parameters": {"student": NAME, "model_kwargs": TINY, "student_kwargs": {"backend": "sdpa"}}},
               ckpt)
    out = tmp_path / "demo.safetensors"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    return student, out


def test_exported_student_loads_with_the_architecture_it_records(tmp_path, capsys):
    student, path = exported_demo_student(tmp_path)
    assert alibi_vit.checkpoint_metadata(path) == {"model": NAME, "model_kwargs": {**TINY, "backend": "sdpa"}}
    model = alibi_vit.create_backbone(NAME, checkpoint=path).eval()  # no kwargs given: read from the file
    x = torch.randn(1, 3, 42, 56)
    with torch.no_grad():
        torch.testing.assert_close(alibi_vit.patch_features(model, x), alibi_vit.patch_features(student, x),
                                   rtol=0, atol=0)
    # The command line needs no --model-arg either.
    assert run_probe(tmp_path, "--checkpoint", str(path), "--size", "56") == 0
    assert "randomly initialised" not in capsys.readouterr().err


def test_given_model_args_override_the_recorded_ones_and_mismatches_are_summarised(tmp_path, capsys):
    _, path = exported_demo_student(tmp_path)
    capsys.readouterr()
    assert run_probe(tmp_path, "--checkpoint", str(path), "--size", "56", "--model-arg", "depth=4") == 2
    err = capsys.readouterr().err
    assert f"warning: checkpoint {path} was exported with depth=2; using the given depth=4" in err
    # blocks 2 and 3 are missing, 14 tensors each (2 norms, qkv, proj, fc1, fc2 with biases; 2 LayerScales):
    # counted, and only the first five named
    assert "(63 tensors; checkpoint 35)" in err
    assert "missing keys (28): blocks.2.attn.proj.bias, blocks.2.attn.proj.weight" in err
    assert "… (23 more)" in err and "blocks.3.norm2.weight" not in err
    assert len(err) < 1000


def test_a_distillation_checkpoint_is_recognised(tmp_path, capsys):
    exported_demo_student(tmp_path)
    capsys.readouterr()
    assert run_probe(tmp_path, "--checkpoint", str(tmp_path / "demo.ckpt"), *TINY_ARGS, "--size", "28") == 2
    err = capsys.readouterr().err
    assert "it holds a distillation run (keys student.*): export the student first" in err
    # Also without the run's architecture (the default 12 blocks here): export records it, so point there.
    assert run_probe(tmp_path, "--checkpoint", str(tmp_path / "demo.ckpt"), "--size", "28") == 2
    assert (f"it holds a distillation run (keys student.*): export the student first, with alibi-vit export "
            f"--checkpoint {tmp_path / 'demo.ckpt'} --out student.safetensors") in capsys.readouterr().err


def test_mismatch_summary_of_a_default_size_model_stays_short(tmp_path):
    _, path = exported_demo_student(tmp_path)
    with pytest.raises(ValueError) as err:  # the 12-block ViT-S default against the 2-block export
        alibi_vit.load_weights(alibi_vit.create_backbone(NAME), alibi_vit.load_state_dict_file(path),
                               source=str(path))
    message = str(err.value)
    # Every one of the 35 exported tensors has the wrong width except pos_embed: a zero one is refilled
    # at the model's own shape by the release rules.
    assert "missing keys (140): " in message and "shape mismatches (34): " in message
    assert len(message) < 1000  # it used to list every key: about 10 KB


def test_help_answers_without_importing_torch_or_timm():
    heavy = "('torch', 'timm', 'sklearn', 'skimage', 'lightning', 'matplotlib', 'scipy')"
    script = ("import sys\nfrom alibi_vit.cli import main\n"
              "def imported(*argv):\n"
              "    try:\n        main(list(argv))\n    except SystemExit:\n        pass\n"
              f"    return sorted(m for m in {heavy} if m in sys.modules)\n"
              "print(repr((imported('--help'), imported('probe', '--help'), imported('show', '--help'))))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    top, probe, show = eval(result.stdout.strip().splitlines()[-1])  # three lists of module names
    assert top == []
    # Subcommand modules load torch and the models inside run(), not for their options.
    assert probe == [] and show == []
    assert "usage: alibi-vit probe" in result.stdout and "--fingerprint-target" in result.stdout


def test_importing_the_package_registers_the_models_even_before_timm_is_imported():
    script = ("import sys\nimport alibi_vit\nassert 'timm' not in sys.modules and 'torch' not in sys.modules\n"
              "from timm import create_model, list_models\n"
              "print(sorted(list_models('alibi_vit_*')), type(create_model('nope_vit_small_patch14_reg4_dinov2', "
              "depth=1)).__name__)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert "'alibi_vit_small_patch14_reg4_dinov2'" in out and "'alibi_vit_giant_patch14_reg4_dinov2'" in out
    import timm  # and in this process, whatever the import order was

    assert "nope_vit_base_patch14_reg4_dinov2" in timm.list_models("nope_vit_*")


def test_error_messages_are_short_and_name_the_file():
    assert format_error(PermissionError(13, "Permission denied", "/data/out.csv")) == "/data/out.csv: Permission denied"
    long = format_error(ValueError("\n".join(f"line {i}" for i in range(30))))
    assert long.splitlines()[-1] == "… (18 more lines)" and len(long.splitlines()) == 13
    assert format_error(KeyError("image")) == "KeyError: 'image'"
    assert format_error(ValueError()) == "ValueError"
    assert format_error(ValueError("x" * 1000)) == "x" * 400 + "… (600 more characters)"


def test_an_unwritable_output_is_a_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert run_probe(tmp_path, *TINY_ARGS, "--size", "28", "--out", str(blocker / "probe.csv")) == 2
    assert str(blocker) in error_of(capsys)



@pytest.mark.parametrize("offline_env", [False, True])
def test_pretrained_weights_offline_fail_fast_naming_the_way_out(tmp_path, capsys, monkeypatch, no_network,
                                                                  offline_env):
    import time

    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", offline_env)
    start = time.perf_counter()
    assert run_probe(tmp_path, "--pretrained", "--size", "28", *TINY_ARGS) == 2
    assert time.perf_counter() - start < 10
    line = error_of(capsys)
    reason = "HF_HUB_OFFLINE is set" if offline_env else "the hub cannot be reached (OSError: [Errno -2]"
    assert f"cannot load the pretrained weights of {NAME}: timm/vit_small_patch14_reg4_dinov2.lvd142m is not in the " \
           "local cache" in line
    assert reason in line
    assert "--checkpoint PATH" in line and "hf download timm/vit_small_patch14_reg4_dinov2.lvd142m" in line
    assert len(no_network) == (0 if offline_env else 1)  # one metadata request, no retries


def test_version_and_help_texts(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"alibi-vit {version('alibi-vit')}"
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "``" not in top and "alibi-vit COMMAND --help" in top
    for action in ("train", "apply", "benchmark"):  # each segment action says what it does
        with pytest.raises(SystemExit):
            main(["segment", action, "--help"])
        usage, _, rest = capsys.readouterr().out.partition("\n\n")
        assert rest.split("\n\n")[0].strip() and not rest.startswith("options:"), rest[:200]
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    assert "(default 224)" in " ".join(capsys.readouterr().out.split())
