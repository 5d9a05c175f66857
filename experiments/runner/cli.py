"""Command-line plumbing shared by the experiment scripts."""

from __future__ import annotations

import sys

from absl import flags


def own_flags_parser(values: flags.FlagValues):
  """An absl ``flags_parser`` for a script whose flags live in their own registry ``values``
  (pytest imports several scripts into one process, and their flag names overlap): the script's
  flags are parsed from ``values``, absl's own (--verbosity, ...) from the global registry, where
  an unknown flag fails."""

  def parse(argv):
    if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv[1:]):
      print(values.get_help())
      sys.exit(0)
    try:
      return flags.FLAGS(values(argv, known_only=True))
    except flags.Error as e:
      sys.exit(f"FATAL Flags parsing error: {e}")

  return parse
