"""Prompt datasets: staging onto shared storage (``staging``) and a built-in toy set (``toy``)."""
