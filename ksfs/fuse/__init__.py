"""The mount (layer 7): a thin pyfuse3 Operations (ops.py) over a pure tree/inode layer (tree.py,
nodes.py), started by ``run_mount`` (mount.py). Never imports click or libvirt."""
