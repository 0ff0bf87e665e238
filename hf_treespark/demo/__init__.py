"""The Gradio demo: one request round by round with no gradio (`run`), and the page (`page`).

Imports: everything below `training`.
"""
