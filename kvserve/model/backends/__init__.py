"""The kernels a model runs on, behind one ``Backend`` protocol (base.py), chosen once by select.py."""
