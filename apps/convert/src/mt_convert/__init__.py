"""mt_convert: the ``mt convert`` command (:mod:`mt_convert.cli`) over the format library
mt-formats (:mod:`mt_formats`)."""

__version__ = "0.1.0"
