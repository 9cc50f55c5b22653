//! A component that is not an idem plugin: it exports `answer` instead of `handler`.

wit_bindgen::generate!({
    inline: "
        package test:other-world@0.1.0;
        world other { export answer: func() -> u32; }
    ",
});

struct Other;

export!(Other);

impl Guest for Other {
    fn answer() -> u32 {
        42
    }
}
