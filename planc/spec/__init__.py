"""The plan as data: format v1, its YAML source with positions, path patterns. No torch here."""
