"""`--show-dir DIR` of tools/test.py, one rule for mmdet, mmseg and mmpretrain configs.

A relative DIR is a folder of the run's log folder, ``<work_dir>/<timestamp>/DIR`` (as mmdet's own hook
places it); an absolute DIR is used as it is. Every test image is drawn once (predictions over the
image, with the ground truth where the library draws it) into ``DIR/<image file name>``.

mmdet's ``DetVisualizationHook`` already follows this rule. The two hooks below give mmseg's and
mmpretrain's hooks the same one: theirs draw every ``interval``-th image only, mmseg's writes through the
visualizer's storage backends (``vis_data/vis_image/...``) and mmpretrain's resolves DIR against the
current directory.
"""
import functools
import os
import os.path as osp


def resolve_show_dir(show_dir, work_dir, timestamp):
    """Folder that `--show-dir` draws into.

    Args:
        show_dir (str): the `--show-dir` value.
        work_dir (str): the runner's work_dir.
        timestamp (str): the runner's timestamp (its log folder's name).

    Returns:
        str: ``show_dir`` when absolute, else ``work_dir/timestamp/show_dir``.
    """
    return show_dir if osp.isabs(show_dir) else osp.join(work_dir, timestamp, show_dir)


@functools.cache
def seg_hook():
    """Register (once) and return the mmseg hook that draws every test image into the show folder."""
    import mmcv
    from mmengine import fileio
    from mmseg.engine.hooks import SegVisualizationHook
    from mmseg.registry import HOOKS

    class ShowDirSegVisualizationHook(SegVisualizationHook):
        """mmseg's visualisation hook, drawing every test image into ``out_dir`` (see module docstring).

        Args:
            out_dir (str): the `--show-dir` value.
            **kwargs: the arguments of ``SegVisualizationHook``.
        """

        def __init__(self, out_dir, **kwargs):
            super().__init__(**kwargs)
            self.out_dir = out_dir

        def before_test(self, runner):
            self.out_dir = resolve_show_dir(self.out_dir, runner.work_dir, runner.timestamp)
            os.makedirs(self.out_dir, exist_ok=True)

        def after_test_iter(self, runner, batch_idx, data_batch, outputs):
            if not self.draw:
                return
            for sample in outputs:
                name = osp.basename(sample.img_path)
                img = mmcv.imfrombytes(fileio.get(sample.img_path, backend_args=self.backend_args),
                                       channel_order='rgb')
                self._visualizer.add_datasample(f'test_{name}', img, data_sample=sample, show=self.show,
                                                wait_time=self.wait_time,
                                                out_file=osp.join(self.out_dir, name))

    HOOKS.register_module(module=ShowDirSegVisualizationHook, force=True)
    return 'ShowDirSegVisualizationHook'


@functools.cache
def cls_hook():
    """Register (once) and return the mmpretrain hook that draws every test image into the show folder."""
    from mmpretrain.engine.hooks import VisualizationHook
    from mmpretrain.registry import HOOKS

    class ShowDirClsVisualizationHook(VisualizationHook):
        """mmpretrain's visualisation hook, drawing every test image into ``out_dir`` (see module
        docstring). The drawn image is the network input before normalisation, as mmpretrain draws it.

        Args:
            out_dir (str): the `--show-dir` value.
            **kwargs: the arguments of ``VisualizationHook``.
        """

        def before_test(self, runner):
            self.out_dir = resolve_show_dir(self.out_dir, runner.work_dir, runner.timestamp)
            os.makedirs(self.out_dir, exist_ok=True)

        def after_test_iter(self, runner, batch_idx, data_batch, outputs):
            if not self.enable:
                return
            for i, (image, sample) in enumerate(zip(data_batch['inputs'], outputs)):
                name = osp.basename(sample.get('img_path', f'{batch_idx}_{i}.png'))
                image = image.permute(1, 2, 0).cpu().numpy().astype('uint8')
                args = {**self.draw_args, 'out_file': osp.join(self.out_dir, name)}
                self._visualizer.visualize_cls(image=image, data_sample=sample, step=0, name=name, **args)

    HOOKS.register_module(module=ShowDirClsVisualizationHook, force=True)
    return 'ShowDirClsVisualizationHook'
