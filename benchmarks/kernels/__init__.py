"""One attention layer's decode step on the GPU. Entry points: ``bench`` (the kernel grid: the
plugin beside flat and cascade kernels, with its parts ``grid``, ``methods``, ``gpu``,
``targets``), ``fa3_levels`` (a cascade step's time level by level), ``split_step`` (a mixed
prefill+decode step's attention split against flat)."""
