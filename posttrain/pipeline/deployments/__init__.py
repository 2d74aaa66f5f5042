"""What sets a Prefect server up for posttrain: block types, default blocks, work pools."""
