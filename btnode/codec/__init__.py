"""Update codecs and the frame format: how block tensors become bytes on the wire and back."""
