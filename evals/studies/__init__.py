"""One-off studies and calibrations: each answers one question from a run or a labelled set,
and its result is quoted in docs/ (reports in docs/reports/)."""
