"""Converters of the offline corpus's source formats to plain text, one module per format: rst,
html_text, pod, sword (IMP entries and OSIS markup), r_lazyload (R data). Pure functions of their
input, tested on small stand-ins in tests/data/test_prepare.py."""
