"""The serving engine k31 plans for: which SGLang build the image carries, that build's command line as
dumped from its own parser (`cli`), and real SGLang's recorded verdict on every planned command (`lane`)."""
