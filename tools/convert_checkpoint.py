"""Convert the authors' release checkpoints into files this plugin loads with torch's safe loader.

    python tools/convert_checkpoint.py SRC DST --model HViT3 --arch tiny [--target backbone|mmpretrain] [--ema]

--target backbone (default): backbone weights for `init_cfg=dict(type='Pretrained', checkpoint=DST)`
    (the configs expect them under data/pretrained/). `init_cfg` also accepts the authors' file directly.
--target mmpretrain: the whole classifier of configs/mmpretrain (backbone + BN + linear head), for
    `python tools/test.py configs/mmpretrain/hvit3_t_in1k.py DST`.
--ema: take the EMA weights (`state_dict_ema` / `model_ema`) instead of `model`.
Keys that do not fit the chosen model and arch are listed and nothing is written.
"""
import argparse
import sys

from mmplugin_l2.checkpoint.convert import convert_checkpoint, save_checkpoint


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('src')
    p.add_argument('dst')
    p.add_argument("--model", required=True, help="backbone type: HViT3, ViT3, L2ViT or ResT")
    p.add_argument('--arch', required=True, help='arch name, e.g. tiny / small / base')
    p.add_argument('--target', default='backbone', choices=['backbone', 'mmpretrain'])
    p.add_argument('--ema', action='store_true', help='convert the EMA weights')
    args = p.parse_args(argv)
    try:
        obj = convert_checkpoint(args.src, args.model, args.arch, args.target, args.ema)
    except (ValueError, FileNotFoundError, KeyError) as err:
        sys.exit(f'error: {err}')
    save_checkpoint(obj, args.dst)
    print(f'wrote {len(obj["state_dict"])} tensors to {args.dst}')


if __name__ == '__main__':
    main()
