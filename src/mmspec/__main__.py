"""``python -m mmspec ...`` — the same as the ``mmspec`` command; the form launchers such as
``torchrun --nproc_per_node=N -m mmspec bench run ...`` need."""

from mmspec.cli import app

app(prog_name="mmspec")
