"""Turn parsed options into library objects: the scheme or plan, the recipe, the KV cache, the calibration ids.

Shared by the subcommands that quantize (quantize, eval with --kv-bits, compare); each error names the option.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

import torch

from llmeasyquant.errors import LLMEasyQuantError

if TYPE_CHECKING:
    from llmeasyquant.scheme import ActMode

log = logging.getLogger("llmeasyquant")


def build_scheme_or_plan(args: argparse.Namespace, recipe: list):
    from llmeasyquant.plan import Plan, Rule
    from llmeasyquant.scheme import parse_scheme

    body = _body_scheme_or_plan(args, recipe)
    if args.lm_head is None:
        return body
    head = parse_scheme(args.lm_head)
    if head.static_act:  # dynamic and online activations need no calibration; nothing calibrates the head
        raise LLMEasyQuantError(f"--lm-head {args.lm_head}: the LM head's input is never calibrated, so it cannot "
                                "take a static activation scale; give it a weight-only scheme (e.g. w8a16) or "
                                "dynamic activations (e.g. w8a8, w4a8-g128)")
    rules = body.rules if isinstance(body, Plan) else Plan.uniform(body).rules
    return Plan((Rule("lm_head", head), *rules))


def _body_scheme_or_plan(args: argparse.Namespace, recipe: list):
    from llmeasyquant.api import default_scheme
    from llmeasyquant.plan import Plan
    from llmeasyquant.scheme import make_scheme

    if args.plan is not None:
        return Plan.load(args.plan)
    mode = act_mode(args)
    grid = getattr(args, "grid", None)
    clip, act_asym = getattr(args, "act_clip", 1.0), getattr(args, "act_asym", False)
    sinks, act_group_size = getattr(args, "act_sinks", 0), getattr(args, "act_group_size", None)
    if ((args.bits, args.group_size, args.act_bits, mode, grid, act_group_size) == (None,) * 6 and not args.asym
            and clip == 1.0 and not act_asym and not sinks):
        return default_scheme(recipe)
    return make_scheme(8 if args.bits is None else args.bits, args.group_size, not args.asym,
                       16 if args.act_bits is None else args.act_bits, act_mode=mode, grid=grid, act_clip=clip,
                       act_symmetric=not act_asym, act_sinks=sinks, act_group_size=act_group_size,
                       momentum=args.act_momentum, eps=args.act_eps, std_floor=args.act_std_floor)


def act_mode(args: argparse.Namespace) -> ActMode | None:
    """--act-mode, with --static as its older spelling; None when neither is given."""
    from llmeasyquant.scheme import ActMode

    given = getattr(args, "act_mode", None)
    mode = None if given is None else ActMode.parse(given)
    if getattr(args, "static", False):
        if mode not in (None, ActMode.STATIC):
            raise LLMEasyQuantError(f"--static contradicts --act-mode {mode}; give one of them")
        return ActMode.STATIC
    return mode


def build_simquant(args: argparse.Namespace):
    """The SimQuant that --kv-bits and its options describe, or None without --kv-bits."""
    if args.kv_bits is None:
        return None
    from llmeasyquant.methods.simquant import SimQuant
    from llmeasyquant.nn.kv.config import KVQuantConfig

    config = KVQuantConfig(key_bits=args.kv_bits, value_bits=args.kv_bits, outliers=args.kv_outliers,
                           sinks=args.kv_sinks, key_channels=args.kv_key_channels, levels=args.kv_levels,
                           key_block=args.kv_key_block, compact=args.kv_compact)
    if args.calib is None:
        log.info("no --calib text: the KV cache tracks key ranges online")
    return SimQuant(config)


def method_options(args: argparse.Namespace) -> dict:
    given = {"act_order": args.act_order, "true_sequential": args.true_sequential, "alpha": args.alpha,
             "lkd": args.lkd, "steps": args.lkd_steps, "lr": args.lkd_lr, "samples": args.lkd_samples,
             "lkd_inputs": args.lkd_inputs, "seed": args.rotation_seed, "online_down": args.online_rotation,
             "online_attention": getattr(args, "online_attention_rotation", None)}
    return {key: value for key, value in given.items() if value is not None}


def apply_preset(args: argparse.Namespace) -> None:
    """Fill in the method, scheme, LM head, KV bits and calibration text that `--preset` names (presets.py); an
    option that would contradict it is an error, not silently overridden."""
    from llmeasyquant.presets import preset
    from llmeasyquant.scheme import parse_scheme

    if getattr(args, "preset", None) is None:
        return
    chosen = preset(args.preset)
    given = [flag for flag, value in (("--method", args.method), ("--bits", args.bits), ("--group-size",
             args.group_size), ("--asym", args.asym or None), ("--act-bits", args.act_bits), ("--plan", args.plan),
             ("--act-mode", args.act_mode), ("--static", args.static or None), ("--grid", args.grid),
             ("--online-rotation", args.online_rotation),
             ("--online-attention-rotation", getattr(args, "online_attention_rotation", None)),
             ("--act-clip", None if getattr(args, "act_clip", 1.0) == 1.0 else args.act_clip),
             ("--act-asym", getattr(args, "act_asym", False) or None),
             ("--act-sinks", getattr(args, "act_sinks", 0) or None),
             ("--act-group-size", getattr(args, "act_group_size", None)))
             if value is not None]
    for flag, mine, theirs in (("--lm-head", args.lm_head, chosen.lm_head), ("--kv-bits", args.kv_bits,
                                                                              chosen.kv_bits)):
        if mine is not None and theirs is not None and mine != theirs:  # adding what the preset leaves open is fine
            given.append(flag)
    if given:
        raise LLMEasyQuantError(f"--preset {chosen.name} sets the recipe ({chosen.options}); drop {', '.join(given)} "
                                "or drop --preset and give the options yourself")
    scheme = parse_scheme(chosen.scheme)
    args.method, args.bits, args.group_size = chosen.method, scheme.bits, scheme.group_size
    args.asym, args.act_bits = not scheme.symmetric, 16 if scheme.act is None else scheme.act.bits
    args.act_clip = 1.0 if scheme.act is None else "search" if scheme.act.clip_search else scheme.act.clip
    args.act_asym = scheme.act is not None and not scheme.act.symmetric
    args.act_sinks = 0 if scheme.act is None else scheme.act.sinks
    args.act_group_size = None if scheme.act is None else scheme.act.group_size
    args.grid, args.online_rotation = scheme.grid, chosen.online_rotation or None
    args.online_attention_rotation = chosen.online_attention or None
    args.lm_head = args.lm_head if chosen.lm_head is None else chosen.lm_head
    args.kv_bits = args.kv_bits if chosen.kv_bits is None else chosen.kv_bits
    args.calib = args.calib or "wikitext2"
    log.info("preset %s: %s", chosen.name, chosen.options)


def build_recipe(args: argparse.Namespace) -> list:
    """The recipe `--method` names (`rtn`, `gptq`, `smoothquant`, `smoothquant+gptq`; rtn when not given) with its
    options."""
    from llmeasyquant.methods import recipe_by_name
    from llmeasyquant.scheme import ActMode

    args.method = args.method or "rtn"
    recipe = recipe_by_name(args.method, **method_options(args))
    static = act_mode(args) is ActMode.STATIC
    if (any(m.needs_calibration for m in recipe) or static) and not args.calib:
        what = "static activation scales" if static else args.method
        raise LLMEasyQuantError(f"{what} needs calibration text: pass --calib wikitext2 (shipped "
                                "WikiText-2 validation), --calib PATH or --calib self")
    return recipe


def build_calibration(args: argparse.Namespace, recipe: list, model: torch.nn.Module, tokenizer: object):
    from llmeasyquant.calibration.data import calibration_ids
    from llmeasyquant.scheme import ActMode

    wanted = any(getattr(m, "needs_calibration", False) for m in recipe) or act_mode(args) is ActMode.STATIC
    if not wanted and not (getattr(args, "kv_bits", None) is not None and args.calib):
        return None
    ids, source = calibration_ids(args.calib, model, tokenizer, args.calib_samples, args.calib_seqlen, args.seed)
    log.info("calibrating on %s: %d samples of %d tokens", source.description, ids.shape[0], ids.shape[1])
    return ids
