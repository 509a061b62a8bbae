"""Reports of a diagnosis: ``diagnosis.json``, the console summary and the HTML page."""
