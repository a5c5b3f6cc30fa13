"""Presentation of result records: terminal and Markdown tables, figures, the HTML report and its browser check."""
