"""Scaling studies: the plan of runs around a base point, the fitted scaling laws, the advice
they support, and the study's plots and report.

May import `render`, `tracking` and every room below.
"""
