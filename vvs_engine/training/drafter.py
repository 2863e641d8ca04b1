"""EAGLE drafter training: teacher-forced features of a frozen target (class labels or the prompts of a
Hugging Face family), and ``vvs-engine train-drafter``."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..drafting.drafter import Drafter, DrafterConfig
from ..errors import VVSError


@dataclass
class PromptConditions:
    """Text conditions of a Hugging Face family for drafter training: one row per token sequence."""

    cond: torch.Tensor  # [N, c] prompt ids (left-padded)
    uncond: torch.Tensor  # [N, c] the family's unconditional rows (used for CFG dropout)
    key_mask: torch.Tensor  # [N, c] bool, False on padding


def _condition_batch(target, labels, idx, drop):
    """-> (condition embeddings [B, c, D], causal mask [B, 1, L, L] or None) for rows ``idx``."""
    if isinstance(labels, PromptConditions):
        ids = torch.where(drop[:, None], labels.uncond[idx], labels.cond[idx])
        return target.embed_condition(ids), labels.key_mask[idx]
    lab = labels[idx].clone()
    lab[drop] = target.config.num_classes  # the null class
    return target.embed_condition(lab), None


def train_drafter(target, tokens: torch.Tensor, labels, steps: int = 600, batch_size: int = 16,
                  lr: float = 1e-3, seed: int = 0, log=print, n_layer: int = 1, loss_weights=None,
                  cfg_dropout: float = 0.1, noise: float = 0.2, progress: bool = True,
                  state_path: str | None = None, save_every: int = 0) -> Drafter:
    """Teacher-forced EAGLE training: features come from the frozen target run on real token
    sequences (10% of rows with the null condition, like CFG dropout); loss
    ``SmoothL1(f̂, f) + 0.1 * CE(target head on f, on f̂)``, uniform feature noise, AdamW.

    ``labels``: class labels [N] (c2i) or :class:`PromptConditions` (text families).
    ``loss_weights``: optional callable ``(feats [B,T,D], logits [B,T,V]) -> [B,T]`` weights for the
    classification term (CASCADE's redundancy re-weighting plugs in here).
    ``state_path``: with ``save_every`` > 0 the head, optimizer, schedule and batch generator are saved
    there every ``save_every`` steps, and a state found there at the start is resumed (same schedule
    required), drawing the batches an uninterrupted run would."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    tc = target.config
    d = Drafter(DrafterConfig(dim=tc.dim, n_head=tc.n_head, n_layer=n_layer)).attach(target)
    target.eval()
    was_trainable = [p.requires_grad for p in target.parameters()]
    for p in target.parameters():
        p.requires_grad_(False)  # frozen: only the draft head learns
    opt = torch.optim.AdamW(d.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 30)) * max(0.05, 1 - s / steps))
    n = tokens.shape[0]
    start = 0
    schedule = dict(steps=steps, batch=batch_size, lr=lr, seed=seed, n_sequences=n, n_layer=n_layer,
                    cfg_dropout=cfg_dropout, noise=noise)
    if state_path and save_every:
        from .state import load_train_state

        state = load_train_state(state_path, schedule)
        if state is not None:
            d.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            g.set_state(state["generator"])
            start = int(state["step"])
            if log:
                log(f"train drafter: resumed at step {start}/{steps} from {state_path}")
    it = range(start, steps)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="train drafter", dynamic_ncols=True, initial=start, total=steps)
    import time

    t_start = time.perf_counter()
    for step in it:
        if log and step == start + 5 and steps - start > 10:  # after a few steps: an estimate of the rest
            per_step = (time.perf_counter() - t_start) / 5
            log(f"train drafter: {per_step:.2f} s/step over the first 5 steps: about "
                f"{per_step * (steps - start) / 60:.1f} min for {steps - start} steps")
        idx = torch.randint(0, n, (batch_size,), generator=g)
        tok = tokens[idx]
        drop = torch.rand(batch_size, generator=g) < cfg_dropout
        with torch.no_grad():
            c = tc.cls_token_num
            cond, key_mask = _condition_batch(target, labels, idx, drop)
            x = torch.cat([cond, target.embed_tokens(tok[:, :-1])], 1)
            mask = None
            if key_mask is not None:  # causal, minus padded prompt slots (a padded query sees itself)
                L = x.shape[1]
                mask = torch.ones(L, L, dtype=torch.bool).tril()[None].repeat(batch_size, 1, 1)
                mask[:, :, :c] &= key_mask[:, None, :]
                mask = (mask | torch.eye(L, dtype=torch.bool)[None]).unsqueeze(1)
            f = target.forward_hidden(x, torch.arange(x.shape[1]), mask=mask)[:, c - 1:]  # f_t, t >= c-1
            tgt_logits = target.logits(f[:, 1:])
        # Inputs: (f_t, x_{t+1}) for t = c-1 .. c+T-2 ; target: f_{t+1}.
        fin = f[:, :-1]
        fin = fin + (torch.rand(fin.shape, generator=g) - 0.5) * noise * 512 / tc.block_size
        pos = torch.arange(c - 1, c - 1 + fin.shape[1])
        pred = d(fin, tok[:, :fin.shape[1]], pos)
        reg = F.smooth_l1_loss(pred, f[:, 1:])
        logp = F.log_softmax(d.logits(pred), -1)
        ce_tok = -(tgt_logits.softmax(-1) * logp).sum(-1)  # [B, T-1]
        if loss_weights is not None:
            w = loss_weights(f[:, 1:], tgt_logits)
            ce = (ce_tok * w).sum() / w.sum()
        else:
            ce = ce_tok.mean()
        loss = reg + 0.1 * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(d.parameters(), 0.5)
        opt.step()
        sched.step()
        if progress and step % 20 == 0:
            with torch.no_grad():
                acc = (logp.argmax(-1) == tgt_logits.argmax(-1)).float().mean()
            it.set_postfix(loss=f"{loss.item():.4f}", top1=f"{acc.item():.3f}")
        if log and (step + 1) % max(1, steps // 10) == 0:
            log(f"drafter step {step + 1}/{steps} loss {loss.item():.4f} reg {reg.item():.4f} ce {ce.item():.4f}")
        if state_path and save_every and ((step + 1) % save_every == 0 or step + 1 == steps):
            from .state import save_train_state

            save_train_state(state_path, schedule=schedule, step=step + 1, model=d.state_dict(),
                             optimizer=opt.state_dict(), scheduler=sched.state_dict(), generator=g.get_state())
    for p, t in zip(target.parameters(), was_trainable):
        p.requires_grad_(t)
    return d.eval()


# --- command line -------------------------------------------------------------------------------

def train_cascade_drafter(target, tokens: torch.Tensor, labels: torch.Tensor, source: str = "logits",
                          threshold: float = 0.625, weight: float = 2.0, **train_kw):
    """``train_drafter`` with CASCADE's redundancy re-weighting of the classification loss."""
    from .cascade import cascade_loss_weights

    return train_drafter(target, tokens, labels, loss_weights=cascade_loss_weights(source, threshold, weight),
                         **train_kw)

def cli_train(argv) -> int:
    """``vvs-engine train-drafter``: train an EAGLE drafter on a target's teacher-forced features.

    c2i token data: ``--tokens FILE`` (.npz or .pt with ``tokens`` [N, T] and ``labels`` [N]) or, by
    default, crops of the Zoo photos (or ``--data-root`` image folder) encoded with the tokenizer.
    ``--model-dir``: prompts plus the user's images (``--images``), token rows (``--tokens``) or images
    the target samples for them."""
    from ..checkpoint import save_safetensors
    from ..engine import Engine, check_load_args
    from ..errors import OneLineParser
    from ..paths import check_writable_file

    ap = OneLineParser(prog="vvs-engine train-drafter",
                       description="Train an EAGLE-style drafter on a target's teacher-forced features.")
    ap.add_argument("--gpt-ckpt", default=None, help="target checkpoint (default: the Zoo target)")
    ap.add_argument("--gpt-model", default=None, help="preset of an official --gpt-ckpt without a config (GPT-B ...)")
    ap.add_argument("--vq-ckpt", default=None, help="tokenizer (default: the Zoo's with the Zoo target)")
    ap.add_argument("--tokens", default=None, help=".npz (or weights-only .pt) with tokens [N, T] and labels [N]")
    ap.add_argument("--data-root", default=None, help="image folder (one sub-folder per class)")
    ap.add_argument("--per-class", type=int, default=300, help="crops per class when encoding images (default 300)")
    ap.add_argument("--steps", type=int, default=600, help="training steps (default 600; the time per step is "
                                                           "measured on the first steps and the total estimated)")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers of the draft head (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--threads", type=int, default=None, metavar="N",
                    help="CPU threads for torch (default: $OMP_NUM_THREADS, else half the cores, at most 4)")
    ap.add_argument("--cascade-weighting", action="store_true",
                    help="CASCADE: 2x classification weight on tokens redundant with a later token")
    ap.add_argument("--model-dir", default=None, metavar="DIR",
                    help="a Hugging Face folder of another family (Janus-Pro, Lumina-mGPT, Emu3); needs --prompts")
    ap.add_argument("--prompts", default=None, metavar="FILE",
                    help="with --model-dir: one prompt per line; token rows come from --images, from --tokens "
                         "(.npz 'tokens', one row per prompt) or are sampled from the target")
    ap.add_argument("--images", default=None, metavar="DIR",
                    help="with --model-dir: an image folder, encoded by the family's VQ encoder; the i-th image "
                         "by file name is captioned by the i-th line of --prompts")
    ap.add_argument("--samples-per-prompt", type=int, default=1, help="sampled images per prompt (default 1)")
    ap.add_argument("--max-prompt-tokens", type=int, default=None, help="prompt padding length (default 128)")
    ap.add_argument("--image-size", type=int, default=None,
                    help="with --model-dir: image side in pixels (Lumina-mGPT default 768, Emu3 default 720)")
    ap.add_argument("--out", required=True, help="output .safetensors path (a .json config is written beside)")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.batch_size < 1 or not a.lr > 0 or a.layers < 1 or a.per_class < 1:
        raise VVSError("--steps, --batch-size, --layers and --per-class must be >= 1 and --lr > 0")
    if not a.out.endswith(".safetensors"):
        raise VVSError("--out must end with .safetensors")
    # Everything checkable is checked before minutes of training: the output and the inputs.
    check_writable_file(a.out, "--out")
    check_writable_file(a.out[: -len(".safetensors")] + ".json", "--out (its .json config)")
    check_load_args(gpt_ckpt=a.gpt_ckpt, gpt_model=a.gpt_model, vq_ckpt=a.vq_ckpt, model_dir=a.model_dir,
                    max_prompt_tokens=a.max_prompt_tokens, image_size=a.image_size if a.model_dir else None,
                    cli=True)
    for flag, path in (("--tokens", a.tokens), ("--prompts", a.prompts)):
        if path is not None and not os.path.isfile(path):
            raise VVSError(f"{flag} {path}: no such file")
    for flag, path in (("--data-root", a.data_root), ("--images", a.images)):
        if path is not None and not os.path.isdir(path):
            raise VVSError(f"{flag} {path}: no such folder")
    if a.model_dir is None and not a.tokens and not a.data_root:
        import importlib.util

        missing = [m for m in ("skimage", "sklearn", "matplotlib") if importlib.util.find_spec(m) is None]
        if missing:
            raise VVSError(f"train-drafter's default data are crops of the Zoo photos from scikit-image, scikit-learn "
                           f"and matplotlib ({', '.join(missing)} missing): pip install -e \".[zoo]\", or give "
                           f"--tokens FILE or --data-root DIR")
    from ..threads import apply_threads

    apply_threads(a.threads, "--threads")
    if a.model_dir is not None:
        eng = Engine.load(model_dir=a.model_dir, max_prompt_tokens=a.max_prompt_tokens, image_size=a.image_size,
                          threads=a.threads)
        tokens, labels = family_training_data(eng, a)
    else:
        if a.images or a.prompts or a.image_size:
            raise VVSError("--images, --prompts and --image-size go with --model-dir (class-conditional data: "
                           "--tokens or --data-root)")
        eng = Engine.load(gpt_ckpt=a.gpt_ckpt, gpt_model=a.gpt_model, vq_ckpt=a.vq_ckpt, threads=a.threads)
        if eng.config.model_type != "c2i":
            raise VVSError("train-drafter supports class-conditional targets, or --model-dir with --prompts")
        tokens, labels = c2i_training_data(eng, a)
    weights = None
    if a.cascade_weighting:  # CASCADE: 2x CE weight where the target's logits repeat a later token's
        from .cascade import cascade_loss_weights

        weights = cascade_loss_weights("logits", 0.625, 2.0)
    d = train_drafter(eng.gpt.float().train(False), tokens, labels, steps=a.steps, batch_size=a.batch_size,
                      lr=a.lr, seed=a.seed, n_layer=a.layers, loss_weights=weights)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    save_safetensors(d, a.out, d.config.to_dict(), kind="drafter",
                     extra={"steps": a.steps, "seed": a.seed, "cascade_weighting": a.cascade_weighting})
    print(f"wrote {a.out}")
    return 0


def family_training_data(eng, a):
    """Prompt conditions and token rows for a Hugging Face family: the user's images (encoded by the
    family's VQ encoder) or tokens, or images the target samples itself for the prompts (temperature 1,
    CFG 4, seeded)."""
    if not a.prompts:
        raise VVSError("--model-dir needs --prompts FILE (one prompt per line)")
    if a.samples_per_prompt < 1:
        raise VVSError("--samples-per-prompt must be >= 1")
    if a.images and a.tokens:
        raise VVSError("give --images or --tokens, not both")
    prompts = read_prompt_file(a.prompts)
    if a.images:
        from .family_images import encode_images, list_images

        paths = list_images(a.images)
        if len(paths) != len(prompts):
            raise VVSError(f"--images has {len(paths)} images but --prompts has {len(prompts)} prompts "
                           f"(one caption per image, in file-name order)")
        tokens = encode_images(eng, a.model_dir, paths)
    elif a.tokens:
        tokens, _ = read_token_file(a.tokens, need_labels=False)
        if tokens.is_floating_point():
            raise VVSError("--tokens must hold integer ids")
        tokens = tokens.long()
        if tokens.shape[0] != len(prompts):
            raise VVSError(f"--tokens has {tokens.shape[0]} rows but --prompts has {len(prompts)} prompts")
    else:
        prompts = [p for p in prompts for _ in range(a.samples_per_prompt)]
        tokens = torch.cat([eng.generate(prompts=prompts[i:i + 8], seed=a.seed + i, cfg_scale=4.0,
                                         decode_images=False).tokens for i in range(0, len(prompts), 8)]).clone()
    if tokens.dim() != 2 or tokens.shape[1] != eng.tokens_per_image:
        raise VVSError(f"tokens must be [N, {eng.tokens_per_image}]")
    if int(tokens.min()) < 0 or int(tokens.max()) >= eng.config.vocab_size:
        raise VVSError(f"token ids must lie in [0, {eng.config.vocab_size})")
    ids, mask = eng.gpt.condition_rows(prompts, True, "cpu")
    n = len(prompts)
    return tokens, PromptConditions(cond=ids[:n], uncond=ids[n:], key_mask=mask[:n])


def c2i_training_data(eng, a):
    """Class-conditional tokens and labels: ``--tokens`` or encoded crops of the Zoo photos."""
    if a.tokens:
        tokens, labels = read_token_file(a.tokens, need_labels=True)
    else:
        if eng.vq is None:
            raise VVSError("no tokenizer loaded: pass --vq-ckpt or --tokens")
        from ..zoo.data import folder_sources, make_crops
        from .family_images import encode_crops

        sources = folder_sources(a.data_root)[0] if a.data_root else None
        crops, labels = make_crops(a.per_class, seed=a.seed, split="train", sources=sources)
        tokens = encode_crops(eng.vq, crops)
        labels = torch.as_tensor(labels)
    if tokens.is_floating_point() or labels.is_floating_point():
        raise VVSError("tokens and labels must be integers")
    tokens, labels = tokens.long(), labels.long()
    if tokens.dim() != 2 or tokens.shape[1] != eng.tokens_per_image or labels.dim() != 1 or len(labels) != len(tokens):
        raise VVSError(f"tokens must be [N, {eng.tokens_per_image}] with one label per row, got tokens "
                       f"{tuple(tokens.shape)} and labels {tuple(labels.shape)}")
    if len(tokens) == 0:
        raise VVSError("no token rows to train on")
    check_ids(tokens, eng.config.vocab_size, "token ids")
    check_ids(labels, eng.config.num_classes, "class labels")
    return tokens, labels


def check_ids(x: torch.Tensor, limit: int, what: str) -> None:
    lo, hi = int(x.min()), int(x.max())
    if lo < 0 or hi >= limit:
        raise VVSError(f"{what} must lie in [0, {limit}), got {lo if lo < 0 else hi}")


def read_token_file(path: str, need_labels: bool):
    """``--tokens``: an .npz, or a torch file read with ``weights_only=True``, holding ``tokens`` [N, T]
    (and ``labels`` [N]) -> (tokens, labels or None); anything else is a one-line error."""
    import pickle
    import zipfile

    import numpy as np

    try:
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as z:
                data = {k: torch.as_tensor(z[k]) for k in z.files if k in ("tokens", "labels")}
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        kind = "an .npz" if path.endswith(".npz") else "a weights-only torch file (tensors only)"
        raise VVSError(f"--tokens {path} is not {kind} ({type(e).__name__}); save tokens [N, T] and labels [N] with "
                       f"numpy.savez") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), torch.Tensor)
                                             for k in (("tokens", "labels") if need_labels else ("tokens",))):
        want = "'tokens' [N, T] and 'labels' [N]" if need_labels else "'tokens' [N, T]"
        have = ", ".join(sorted(map(str, data))) if isinstance(data, dict) else type(data).__name__
        raise VVSError(f"--tokens {path} must hold {want} arrays; it holds {have or 'nothing'}")
    return data["tokens"], data.get("labels")


def read_prompt_file(path: str):
    """One prompt per non-empty line (the format of ``vvs-engine generate --prompts``)."""
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise VVSError(f"cannot read prompts file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not prompts:
        raise VVSError(f"prompts file {path} holds no prompts")
    return prompts
