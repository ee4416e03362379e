"""A lesson 08 checkpoint loaded into the PyTorch reference model (tests/reference/model.py):
the weights go elsewhere as they are, and the loss they give on lesson 08's validation batch
is lesson 08's.

usage: load_checkpoint.py CHECKPOINT DUMP_DIR
  CHECKPOINT  a checkpoint directory (lessons/08_mesh/checkpoint_io.h: manifest.json and one .npy
              per full tensor, named as model.h names the weights)
  DUMP_DIR    lesson 08's --dump of a run resumed from it with no training step
              (--resume CHECKPOINT --train 0 --dump DUMP_DIR): its validation batch 0
              (val_inputs, val_targets) and the loss the mesh computed on it (val_loss)

The checkpoint's manifest says the model's sizes; the reference model's module constants are set
from it (and the batch's shape), every weight and balancing bias is loaded from its .npy as a
float64 torch tensor, and model.py's model_loss gives the loss of the batch. It must be within
lesson 08's own bound of the mesh's float32 loss, 4 n eps max(1, |loss|) with n = B T. The
manifest's own CRC-32 (manifest.crc32) and its CRC-32 of every file are checked first (zlib's,
as the lesson writes them).
"""
import json
import os
import sys
import zlib

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as ref  # noqa: E402  (tests/reference/model.py)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    ckpt, dump = sys.argv[1:]
    with open(os.path.join(ckpt, "manifest.json"), "rb") as f:
        text = f.read()
    with open(os.path.join(ckpt, "manifest.crc32")) as f:
        if f.read().strip() != f"{zlib.crc32(text):08x}":
            sys.exit(f"error: {ckpt}/manifest.json: its CRC-32 is not manifest.crc32's")
    manifest = json.loads(text)
    if manifest.get("format") != "fivefold lesson 08 checkpoint" or manifest.get("version") != 2:
        sys.exit(f"error: {ckpt}: not a version 2 lesson 08 checkpoint")
    for name, t in manifest["tensors"].items():
        with open(os.path.join(ckpt, name + ".npy"), "rb") as f:
            data = f.read()
        if zlib.crc32(data) != t["crc32"] or len(data) != t["bytes"]:
            sys.exit(f"error: {ckpt}/{name}.npy: checksum mismatch")
    m = manifest["model"]
    ref.V, ref.D, ref.LAYERS, ref.DENSE, ref.H = m["vocab"], m["dim"], m["layers"], m["dense_layers"], m["heads"]
    ref.D_NOPE, ref.D_ROPE, ref.D_V = m["d_nope"], m["d_rope"], m["d_v"]
    ref.Q_LORA, ref.KV_LORA, ref.FFN = m["q_lora"], m["kv_lora"], m["ffn"]
    ref.EXPERTS, ref.TOPK, ref.SHARED, ref.MOE_FFN = m["experts"], m["topk"], m["shared"], m["moe_ffn"]
    ref.ROPE_THETA, ref.NORM_EPS = m["rope_theta"], m["norm_eps"]
    if m["route_scale"] != 1.0:
        sys.exit("error: model.py's MoE has route_scale 1")
    inputs = np.load(os.path.join(dump, "val_inputs.npy"))
    targets = np.load(os.path.join(dump, "val_targets.npy"))
    want = float(np.load(os.path.join(dump, "val_loss.npy")))
    ref.B, ref.T = inputs.shape
    tokens = torch.from_numpy(np.concatenate([inputs, targets[:, -1:]], axis=1).astype(np.int64))
    if not torch.equal(tokens[:, 1:], torch.from_numpy(targets.astype(np.int64))):
        sys.exit("error: the targets are not the inputs shifted by one")
    names = [n for n, _ in ref.param_shapes()] + [f"layers.{i}.moe.bias" for i in range(ref.DENSE, ref.LAYERS)]
    p = {n: torch.from_numpy(np.load(os.path.join(ckpt, n + ".npy")).astype(np.float64)) for n in names}
    with torch.no_grad():
        loss, _, margin = ref.model_loss(p, tokens)
    n = ref.B * ref.T
    tol = 4 * n * np.finfo(np.float32).eps * max(1.0, abs(want))
    diff = abs(loss.item() - want)
    print(f"checkpoint {ckpt}: {manifest['steps_done']} steps, {len(names)} tensors loaded into the PyTorch reference")
    print(f"validation batch 0: PyTorch (float64) {loss.item():.6f}, lesson 08 (float32 mesh) {want:.6f}, "
          f"|diff| {diff:.2e} <= {tol:.2e}: {'ok' if diff <= tol else 'FAIL'} "
          f"(smallest routing margin {margin:.1e})")
    sys.exit(0 if diff <= tol else 1)


if __name__ == "__main__":
    main()
