"""Datasets as RecordIO shards of serialized ``tf.train.Example`` records: writing, converting, inspecting."""
