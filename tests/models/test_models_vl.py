"""Qwen2.5-VL from dualop ops (dualop/models/qwen2_5_vl.py) against transformers' own model.

The reference is a tiny random transformers ``Qwen2_5_VLForConditionalGeneration`` (text: 2 layers,
hidden 64, 4 heads, 2 kv heads; vision: depth 3 with block 1 full-attention, hidden 32, patch 4,
windows of 2 x 2 merged units, so the test images split into several windows, some partial) saved
with ``save_pretrained`` and loaded by ``dualop.models.from_pretrained`` in both frontends:

- float32: the encoder's output (``model.model.visual(...).pooler_output``, 1 and 2 images of other
  grids) and the logits (text only; text with images, transformers' 3-D rope positions) within 1e-4
  relative (max abs diff / max abs ref); greedy generation token for token (text prompts of three
  lengths, and a prompt with images), with prefill chunked by a 16-token step budget;
- bfloat16: the encoder against transformers' bfloat16 model within the tolerance table's bfloat16
  row, normwise (``testing.compare(..., "bfloat16", normwise=True)``: atol + rtol * max|ref|);
- ``custom_ops=["none"]`` (every op native) and the Pallas (``tpu``, JAX's TPU interpreter) and
  Triton (``cuda``, Triton's interpreter) paths run inside the encoder, checked by the dispatch report;
- tp=2 equals tp=1 (jax: 8 host devices in a subprocess; torch: 2 gloo processes): the sharded
  text model's logits and generations, and the encoder, which stays replicated at tp > 1;
- bad input: clear errors naming the argument, raised before any op runs.

Comparisons with transformers are marked ``reference`` (they run in the 'latest' environment only).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dualop import OpsConfig, dispatch_report, override_platform, set_config, testing
from dualop.models import CheckpointError, from_pretrained

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.dirname(os.path.abspath(__file__))

IMAGE_TOKEN, VISION_START, VISION_END, EOS = 250, 252, 253, 255
PATCH_FEATURES = 3 * 2 * 4 * 4  # channels x temporal_patch_size x patch_size**2
ONE_IMAGE = np.array([[1, 6, 10]])  # 3 x 5 merged units: windows of 4, 4, 2 | 2, 2, 1 units
TWO_IMAGES = np.array([[2, 4, 8], [1, 8, 4]])  # two frames (two full-attention segments); a tall one
TEXT_PROMPTS = [[7, 3, 101], [12, 40, 41, 42, 9, 200, 33, 17, 5, 61, 62], list(range(20, 47))]
SERVING = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, page_size=8)
RTOL_F32 = 1e-4  # max abs diff / max abs reference


def relative_error(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max())


def make_checkpoint(path: str) -> None:
    """A tiny random Qwen2.5-VL, saved as transformers saves it."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.1, eos_token_id=EOS, bos_token_id=254,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           temporal_patch_size=2, spatial_merge_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1], initializer_range=0.1),
        image_token_id=IMAGE_TOKEN, video_token_id=251, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)


def pixels(grid: np.ndarray, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((int(grid.prod(-1).sum()), PATCH_FEATURES)).astype(np.float32)


def image_prompt(grid: np.ndarray) -> list[int]:
    """Text around each image's placeholders (t*h*w / 4 of them, between vision start and end)."""
    ids = [3, 4]
    for t, h, w in grid:
        ids += [VISION_START] + [IMAGE_TOKEN] * int(t * h * w // 4) + [VISION_END, 11]
    return ids + [12, 13]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    path = str(tmp_path_factory.mktemp("qwen2_5_vl"))
    make_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def models(checkpoint):
    """``get(frontend, dtype)``: one loaded model per (frontend, dtype), shared by the module's tests."""
    cache = {}

    def get(frontend: str, dtype: str = "float32"):
        if (frontend, dtype) not in cache:
            importlib.import_module("torch" if frontend == "torch" else "jax")
            cache[frontend, dtype] = from_pretrained(checkpoint, frontend=frontend, dtype=dtype, **SERVING)
        return cache[frontend, dtype]

    return get


@pytest.fixture(scope="module")
def hf(checkpoint):
    """transformers' outputs for the module's inputs."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for name, grid, seed in (("one", ONE_IMAGE, 1), ("two", TWO_IMAGES, 2)):
            out[f"encoder_{name}"] = model.model.visual(torch.from_numpy(pixels(grid, seed)),
                                                        grid_thw=torch.from_numpy(grid)).pooler_output.numpy()
        out["logits"] = model(torch.tensor([TEXT_PROMPTS[2]])).logits[0].numpy()
        out["generate"] = []
        for prompt in TEXT_PROMPTS:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
            out["generate"].append(gen[0, len(prompt):].tolist())
        ids = torch.tensor([image_prompt(TWO_IMAGES)])
        image_kwargs = dict(pixel_values=torch.from_numpy(pixels(TWO_IMAGES, 2)),
                            image_grid_thw=torch.from_numpy(TWO_IMAGES), mm_token_type_ids=(ids == IMAGE_TOKEN).int())
        out["image_logits"] = model(input_ids=ids, **image_kwargs).logits[0].numpy()
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             **image_kwargs)
        out["image_generate"] = gen[0, ids.shape[1]:].tolist()
        bf16 = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
        out["encoder_two_bf16"] = bf16.model.visual(torch.from_numpy(pixels(TWO_IMAGES, 2)).bfloat16(),
                                                    grid_thw=torch.from_numpy(TWO_IMAGES)).pooler_output.float().numpy()
    return out


FRONTENDS = ["torch", "jax"]


@pytest.mark.reference
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_encoder_matches_transformers(frontend, models, hf):
    model = models(frontend)
    for name, grid, seed in (("one", ONE_IMAGE, 1), ("two", TWO_IMAGES, 2)):
        out = model.encode_images(pixels(grid, seed), grid)
        assert type(out).__module__.split(".")[0] in ({"torch"} if frontend == "torch" else {"jax", "jaxlib"})
        got = model.frontend.to_numpy(out)
        assert got.shape == hf[f"encoder_{name}"].shape == (int(grid.prod(-1).sum()) // 4, 64)
        assert relative_error(got, hf[f"encoder_{name}"]) < RTOL_F32, name


@pytest.mark.reference
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_text_logits_and_generate_match_transformers(frontend, models, hf):
    model = models(frontend)
    logits = model.frontend.to_numpy(model.logits(TEXT_PROMPTS[2]))
    assert logits.shape == hf["logits"].shape
    assert relative_error(logits, hf["logits"]) < RTOL_F32
    # the 27-token prompt prefills in chunks (16-token step budget) beside the others' decodes
    assert model.generate(TEXT_PROMPTS, max_new_tokens=16) == hf["generate"]


@pytest.mark.reference
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_text_with_images_matches_transformers(frontend, models, hf):
    model = models(frontend)
    ids, px = image_prompt(TWO_IMAGES), pixels(TWO_IMAGES, 2)
    logits = model.frontend.to_numpy(model.logits(ids, pixel_values=px, image_grid_thw=TWO_IMAGES))
    assert relative_error(logits, hf["image_logits"]) < RTOL_F32
    # the same prompt without its images' rows and positions is a different sequence
    assert relative_error(model.frontend.to_numpy(model._sequence_logits(ids)), hf["image_logits"]) > 1e-2
    # with a text prompt beside it in the batch; its 34 prompt tokens prefill in chunks of <= 16
    out = model.generate([ids, TEXT_PROMPTS[1]], max_new_tokens=8, images=[(px, TWO_IMAGES), None])
    assert out == [hf["image_generate"], hf["generate"][1][:8]]


@pytest.mark.reference
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_bfloat16_encoder_within_the_tolerance_table(frontend, models, hf):
    model = models(frontend, "bfloat16")
    out = model.encode_images(pixels(TWO_IMAGES, 2), TWO_IMAGES)
    assert "bfloat16" in str(out.dtype)
    cmp = testing.compare(model.frontend.to_numpy(out), hf["encoder_two_bf16"], "bfloat16", normwise=True)
    assert cmp.ok, cmp


ENCODER_OPS = {"conv3d", "rms_norm", "replicated_linear", "column_parallel_linear", "apply_rotary_emb",
               "mm_encoder_attn", "silu_and_mul"}


def encoder_rows(frontend_family: str) -> dict[str, dict]:
    rows = {r["op"]: r for r in dispatch_report() if r["op"] in ENCODER_OPS and r["frontend"] == frontend_family}
    assert set(rows) == ENCODER_OPS, sorted(rows)
    return rows


@pytest.mark.reference
@pytest.mark.parametrize("frontend, custom_ops, platform, method", [
    ("torch", "none", None, "forward_native"),
    ("jax", "none", None, "forward_native"),
    ("jax", "all", "tpu", "forward_tpu"),  # Pallas kernels, JAX's TPU interpreter
    ("torch", "all", "cuda", "forward_cuda"),  # Triton kernels, Triton's interpreter
])
def test_encoder_paths(frontend, custom_ops, platform, method, checkpoint, hf):
    """A fresh model (a jax program is traced, and its ops dispatched, inside the context)."""
    importlib.import_module("torch" if frontend == "torch" else "jax")
    model = from_pretrained(checkpoint, frontend=frontend, **SERVING)
    platform_ctx = override_platform(platform) if platform else contextlib.nullcontext()
    with set_config(OpsConfig([custom_ops])), platform_ctx:
        got = model.frontend.to_numpy(model.encode_images(pixels(ONE_IMAGE, 1), ONE_IMAGE))
    assert relative_error(got, hf["encoder_one"]) < RTOL_F32
    rows = encoder_rows(frontend)
    assert {op: r["method"] for op, r in rows.items()} == {op: method for op in ENCODER_OPS}, rows


# --- tensor parallelism ---------------------------------------------------------------------------

TP_IMAGE = np.array([[1, 4, 4]])  # 4 placeholders: every tp step has at most 16 tokens (one jax program shape)


def tp_outputs(model, to_numpy) -> dict:
    """What the tp tests compare: logits of a text prompt and of a prompt with an image (through the
    encoder, replicated at tp > 1), greedy tokens of both in one batch; JSON-able."""
    ids, px = image_prompt(TP_IMAGE), pixels(TP_IMAGE, 3)
    return dict(
        text_logits=to_numpy(model.logits(TEXT_PROMPTS[1])).tolist(),
        image_logits=to_numpy(model.logits(ids, pixel_values=px, image_grid_thw=TP_IMAGE)).tolist(),
        generate=model.generate([TEXT_PROMPTS[0], ids], max_new_tokens=6, images=[None, (px, TP_IMAGE)]),
    )


def check_tp(got: dict, want: dict) -> None:
    for key in ("text_logits", "image_logits"):
        cmp = testing.compare(np.asarray(got[key], np.float32), np.asarray(want[key], np.float32), "float32",
                              normwise=True)
        assert cmp.ok, (key, cmp)
    assert got["generate"] == want["generate"]


def _torch_tp(rank: int, world: int, port: int, path: str, out: str) -> None:
    from dualop.torch import parallel as tparallel

    with testing.gloo_group(rank, world, port):
        tparallel.init_tensor_parallel_group()
        model = from_pretrained(path, frontend="torch", tp=world, **SERVING)
        result = tp_outputs(model, lambda x: x.float().numpy())
        result["shapes"] = [list(model.params[k].shape) for k in ("0.qkv", "visual.0.qkv")]
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)


@pytest.mark.once_in_xla
def test_torch_tp2_equals_tp1(checkpoint, models, tmp_path):
    torch = importlib.import_module("torch")
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    out = str(tmp_path / "result")
    mp.spawn(_torch_tp, args=(2, testing.free_port(), checkpoint, out), nprocs=2, join=True)
    want = tp_outputs(models("torch"), lambda x: x.float().numpy())
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            got = json.load(f)
        # the decoder's qkv holds this rank's 2 of 4 q heads and 1 of 2 kv heads; the encoder's is whole
        assert got["shapes"] == [[32 + 2 * 16, 64], [96, 32]], got["shapes"]
        check_tp(got, want)


_JAX_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import numpy as np
    from dualop.models import from_pretrained
    from test_models_vl import SERVING, tp_outputs

    model = from_pretrained(sys.argv[1], frontend="jax", tp=2, **SERVING)
    result = tp_outputs(model, lambda x: np.asarray(x, np.float32))
    qkv = model.params["0.qkv"]
    result.update(spec=[str(s) for s in qkv.sharding.spec], devices=len(qkv.sharding.device_set),
                  encoder_spec=[str(s) for s in model.params["visual.0.qkv"].sharding.spec])
    print("RESULTS " + json.dumps(result))
""")


@pytest.mark.once_in_xla
def test_jax_tp2_equals_tp1(checkpoint, models):
    importlib.import_module("jax")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", _JAX_SCRIPT, checkpoint], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    got = json.loads(line.removeprefix("RESULTS "))
    # qkv rows split over the 2 devices of the mesh; the encoder's weights replicated
    assert got["devices"] == 2 and got["spec"] == ["tp", "None"] and got["encoder_spec"] == [], got
    check_tp(got, tp_outputs(models("jax"), lambda x: np.asarray(x, np.float32)))


# --- bad input ------------------------------------------------------------------------------------

@pytest.mark.latest_only
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_bad_images_are_refused_before_any_op_runs(frontend, checkpoint):
    importlib.import_module("torch" if frontend == "torch" else "jax")
    model = from_pretrained(checkpoint, frontend=frontend, **SERVING)  # fresh: no jax program traced yet
    name = "Qwen2_5_VLForConditionalGeneration"
    px, ids = pixels(TWO_IMAGES, 2), image_prompt(TWO_IMAGES)
    cases = [
        (lambda: model.encode_images(px, TWO_IMAGES[0]),
         r"encode_images: argument 'image_grid_thw' must be \[num_images, 3\]"),
        (lambda: model.encode_images(px, [[1, 6, 9]]),
         r"argument 'image_grid_thw' has rows \[\[1, 6, 9\]\].*spatial_merge_size=2"),
        (lambda: model.encode_images(px[:-1], TWO_IMAGES),
         r"argument 'pixel_values' has shape \(95, 96\); expected \(96, 96\)"),
        (lambda: model.encode_images(px[:, :64], TWO_IMAGES),
         r"argument 'pixel_values' has shape \(96, 64\); expected \(96, 96\)"),
        (lambda: model.logits(ids, pixel_values=px), r"logits: argument 'image_grid_thw' is required"),
        (lambda: model.logits(ids), r"placeholders but no pixel_values"),
        (lambda: model.logits(ids[:-8] + ids[-4:], pixel_values=px, image_grid_thw=TWO_IMAGES),
         r"image 1 \(image_grid_thw \[1, 8, 4\]\) needs 8 consecutive image_token_id=250 placeholders"),
        (lambda: model.logits(ids, pixel_values=px[:64], image_grid_thw=TWO_IMAGES[:1]),
         r"more image_token_id=250 placeholders than image_grid_thw has images \(1\)"),
        (lambda: model.generate([ids], 4, images=[(px, TWO_IMAGES), None]),
         r"generate: argument 'images' must be a list"),
        (lambda: model.generate([ids, [1, 2]], 4, images=[(px[1:], TWO_IMAGES), None]),
         r"generate: prompt 0: argument 'pixel_values' has shape"),
    ]
    for call, pattern in cases:
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert message.startswith(name) and re.search(pattern, message), (pattern, message)
    assert dispatch_report() == [], "an op ran before the error"


@pytest.mark.latest_only
def test_a_checkpoint_that_does_not_match_its_config_is_refused(checkpoint, tmp_path):
    importlib.import_module("torch")
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    config["vision_config"]["depth"] = 4
    for name in os.listdir(checkpoint):
        if name.endswith(".safetensors"):
            os.symlink(os.path.join(checkpoint, name), tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing tensors \(12\): visual\.blocks\.3\.norm1\.weight"):
        from_pretrained(str(tmp_path), frontend="torch")
    config["vision_config"]["depth"], config["vision_config"]["out_hidden_size"] = 3, 48
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vision out_hidden_size=48 must equal the text hidden_size=64"):
        from_pretrained(str(tmp_path), frontend="torch")
