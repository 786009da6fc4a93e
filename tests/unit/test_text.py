from llmd.backends.llamacpp.text import TextStream


def test_multibyte_characters_are_never_split():
    s = TextStream()
    data = "héllo €".encode()
    out = []
    for b in data:  # one byte per "token"
        text, stopped = s.push(bytes([b]))
        assert not stopped
        out.append(text)
        assert "\ufffd" not in text
    out.append(s.flush())
    assert "".join(out) == "héllo €"


def test_stop_string_is_cut_and_never_leaks_a_partial_match():
    s = TextStream(("</end>",))
    emitted = []
    for piece in ["Hello", " wor", "ld<", "/en", "d> after"]:
        text, stopped = s.push(piece.encode())
        emitted.append(text)
        if stopped:
            break
    assert stopped
    assert "".join(emitted) == "Hello world"
    assert all("<" not in e for e in emitted)


def test_held_text_is_released_when_it_stops_matching():
    s = TextStream(("STOP",))
    a, _ = s.push(b"abc ST")
    assert a == "abc "
    b, stopped = s.push(b"OCK")
    assert not stopped and b == "STOCK"


def test_flush_releases_held_prefix_at_end_of_generation():
    s = TextStream(("###",))
    text, _ = s.push(b"answer #")
    assert text == "answer "
    assert s.flush() == "#"


def test_earliest_of_several_stops_wins():
    s = TextStream(("b", "a"))
    text, stopped = s.push(b"xxab")
    assert stopped and text == "xx"
