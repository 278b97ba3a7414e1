"""Deployment specs: the chart, its schema, the image recipe, the examples and the docs."""
