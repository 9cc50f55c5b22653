/* idem.h: write an idem plugin in C or C++ (clang for wasm32-wasi, built by `idem build`).
 * JSON field access whose failures name the field, and builders for outcomes, effects and
 * statement parameters, over the bindings `idem build` generates into bindings/plugin.h.
 *
 * In exactly one source file, define IDEM_IMPLEMENTATION before including this header, and
 * define the handler:
 *
 *     #define IDEM_IMPLEMENTATION
 *     #include "idem.h"
 *
 *     idem_result idem_handle(const idem_message *message) {
 *         const idem_json *event;
 *         int64_t order_id;
 *         IDEM_TRY(idem_parse_object(message, &event));
 *         IDEM_TRY(idem_integer_field(event, "order_id", &order_id));
 *         return idem_decision(idem_format("order:%" PRId64, order_id),
 *                              idem_exec("record_order", idem_int(order_id)));
 *     }
 *
 * An accessor that fails returns false and keeps the failure; `IDEM_TRY` returns it. A
 * failure's reason is what an operator reads in the dead-letter queue and what a case in
 * cases.json matches. Text made by idem_format, idem_render, idem_header and idem_attribute,
 * and parsed events, live until the handler returns; builders copy what they are given. In
 * C++ (clang++, no exceptions) pass effects and parameters as braced lists:
 * `idem_decision(key, {idem_exec("record_order", {idem_int(order_id)})})`.
 */
#ifndef IDEM_H
#define IDEM_H

#include "plugin.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One delivery: pipeline, source, queue, subject, body, headers, message_id, redelivered,
 * delivery_count and attributes (see bindings/plugin.h). */
typedef idem_plugin_types_message_t idem_message;
/* A statement parameter: idem_null, idem_bool, idem_int, idem_float, idem_text, idem_json_text,
 * idem_bytes, idem_timestamp. */
typedef idem_plugin_types_value_t idem_value;
/* An effect: idem_exec, idem_outbox. */
typedef idem_plugin_types_effect_t idem_effect;

/* What the handler returns: idem_decision, idem_skip, idem_invalid, idem_retryable. */
typedef struct {
    bool ok;
    idem_plugin_types_outcome_t outcome;
    idem_plugin_types_failure_t failure;
} idem_result;

/* The plugin's handler: define it in one of your sources. */
idem_result idem_handle(const idem_message *message);

/* ---- JSON ------------------------------------------------------------------------------- */

typedef enum {
    IDEM_NULL,
    IDEM_BOOLEAN,
    IDEM_NUMBER,
    IDEM_STRING,
    IDEM_ARRAY,
    IDEM_OBJECT
} idem_kind;

/* A parsed JSON value. A number keeps its source text in `text`, exact; a string is decoded
 * UTF-8 in `text`, NUL-terminated (`length` counts its bytes, a \u0000 included). An object's
 * members are `items` with `keys`, in the body's order; an array has `items` only. */
typedef struct idem_json {
    idem_kind kind;
    bool boolean;
    char *text;
    size_t length;
    struct idem_json *items;
    char **keys;
    size_t count;
} idem_json;

/* Parses `length` bytes of `text` as one JSON document (strict: UTF-8, no NaN, nothing after
 * it); on failure `*error` says what and `*error_at` where (a byte offset). Free the value
 * with idem_json_free. */
bool idem_json_parse(const uint8_t *text, size_t length, idem_json *value, const char **error, size_t *error_at);
void idem_json_free(idem_json *value);

/* The body as a JSON object (UTF-8, strict JSON); anything else is invalid input. */
bool idem_parse_object(const idem_message *message, const idem_json **event);
/* Member `name` of `object` (the last, if repeated), or NULL when absent. */
const idem_json *idem_get(const idem_json *object, const char *name);
/* "null", "a boolean", "a number", "a string", "an array" or "an object", for reasons. */
const char *idem_json_kind(const idem_json *value);
/* `value` as compact JSON text (a number as written). */
char *idem_render(const idem_json *value);

/* Field accessors: false (with the failure kept for IDEM_TRY) when the field is missing, null
 * or of another type. The optional ones set `*present` false for a missing or null field. */
bool idem_integer_field(const idem_json *event, const char *name, int64_t *out);
bool idem_optional_integer_field(const idem_json *event, const char *name, int64_t *out, bool *present);
bool idem_float_field(const idem_json *event, const char *name, double *out);
bool idem_text_field(const idem_json *event, const char *name, const char **out);
bool idem_optional_text_field(const idem_json *event, const char *name, const char **out, bool *present);
bool idem_boolean_field(const idem_json *event, const char *name, bool *out);
bool idem_object_field(const idem_json *event, const char *name, const idem_json **out);

/* The failure the last accessor kept. */
idem_result idem_failed(void);
#define IDEM_TRY(accessed) \
    do { \
        if (!(accessed)) return idem_failed(); \
    } while (0)

/* ---- The message ------------------------------------------------------------------------ */

/* Header `name` (compared without case), or NULL when absent. */
const char *idem_header(const idem_message *message, const char *name);
/* Attribute `name` (RabbitMQ's `exchange`, `routing-key`; JetStream's `stream-sequence`…). */
const char *idem_attribute(const idem_message *message, const char *name);

/* ---- Builders ---------------------------------------------------------------------------- */

idem_value idem_null(void);
idem_value idem_bool(bool flag);
idem_value idem_int(int64_t integer);
idem_value idem_float(double number);
idem_value idem_text(const char *text);
/* A JSON document, as text, bound to a json/jsonb parameter. */
idem_value idem_json_text(const char *json);
idem_value idem_bytes(const uint8_t *bytes, size_t length);
/* A timestamptz, in microseconds since 1970-01-01T00:00:00Z. */
idem_value idem_timestamp(int64_t micros);

/* Run the pipeline's statement `statement` with `count` parameters ($1, $2, … in order). */
idem_effect idem_exec_n(const char *statement, const idem_value *params, size_t count);
/* Send `payload` to an outbox destination after the commit; `key` NULL: the decision's. */
idem_effect idem_outbox(const char *destination, const uint8_t *payload, size_t length, const char *key);
/* Claim `key`, then apply the effects in order, in one transaction. */
idem_result idem_decision_n(const char *key, const idem_effect *effects, size_t count);

#if defined(__GNUC__)
#define IDEM_PRINTF(format_index, first_argument) __attribute__((format(printf, format_index, first_argument)))
#else
#define IDEM_PRINTF(format_index, first_argument)
#endif
/* Not for this consumer: acked with no claim and no effect. */
idem_result idem_skip(const char *format, ...) IDEM_PRINTF(1, 2);
/* The message can never succeed: it is dead-lettered with the reason. */
idem_result idem_invalid(const char *format, ...) IDEM_PRINTF(1, 2);
/* Trying again later may succeed: the host retries a bounded number of times. */
idem_result idem_retryable(const char *format, ...) IDEM_PRINTF(1, 2);
/* printf into new text, kept until the handler returns. */
char *idem_format(const char *format, ...) IDEM_PRINTF(1, 2);
/* Logs through the host (32 lines per message at most). */
void idem_log(idem_plugin_log_level_t level, const char *format, ...) IDEM_PRINTF(2, 3);

#ifndef __cplusplus
/* idem_exec("statement", idem_int(1), idem_text("a")): one parameter or more. */
#define idem_exec(statement, ...) \
    idem_exec_n((statement), (const idem_value[]){__VA_ARGS__}, \
                sizeof((const idem_value[]){__VA_ARGS__}) / sizeof(idem_value))
/* idem_decision(key, effect, …): one effect or more. */
#define idem_decision(key, ...) \
    idem_decision_n((key), (const idem_effect[]){__VA_ARGS__}, \
                    sizeof((const idem_effect[]){__VA_ARGS__}) / sizeof(idem_effect))
#endif

#ifdef __cplusplus
}

#include <initializer_list>

inline idem_effect idem_exec(const char *statement, std::initializer_list<idem_value> params) {
    return idem_exec_n(statement, params.begin(), params.size());
}

inline idem_result idem_decision(const char *key, std::initializer_list<idem_effect> effects) {
    return idem_decision_n(key, effects.begin(), effects.size());
}
#endif

#ifdef IDEM_IMPLEMENTATION
#ifdef __cplusplus
extern "C" {
#endif

/* ---- JSON parsing (strict RFC 8259: no NaN, no trailing text, UTF-8 only) ---------------- */

/* How deep arrays and objects may nest, as serde_json allows. */
#define IDEM_JSON_DEPTH 128

typedef struct {
    const unsigned char *at;
    const unsigned char *end;
    const char *error;
    size_t error_at;
    const unsigned char *start;
} idem_json_reader;

static bool idem_json_fail(idem_json_reader *reader, const char *error) {
    if (reader->error == NULL) {
        reader->error = error;
        reader->error_at = (size_t)(reader->at - reader->start);
    }
    return false;
}

static void idem_json_space(idem_json_reader *reader) {
    while (reader->at < reader->end &&
           (*reader->at == ' ' || *reader->at == '\t' || *reader->at == '\n' || *reader->at == '\r')) {
        reader->at++;
    }
}

/* The length of the valid UTF-8 sequence at `at` (0 when invalid). */
static size_t idem_utf8_length(const unsigned char *at, const unsigned char *end) {
    unsigned char first = at[0];
    size_t length;
    uint32_t point;
    if (first < 0x80) return 1;
    if (first >= 0xC2 && first <= 0xDF) { length = 2; point = first & 0x1F; }
    else if (first >= 0xE0 && first <= 0xEF) { length = 3; point = first & 0x0F; }
    else if (first >= 0xF0 && first <= 0xF4) { length = 4; point = first & 0x07; }
    else return 0;
    if ((size_t)(end - at) < length) return 0;
    for (size_t index = 1; index < length; index++) {
        if ((at[index] & 0xC0) != 0x80) return 0;
        point = (point << 6) | (at[index] & 0x3F);
    }
    if ((length == 3 && (point < 0x800 || (point >= 0xD800 && point <= 0xDFFF))) ||
        (length == 4 && (point < 0x10000 || point > 0x10FFFF))) {
        return 0;
    }
    return length;
}

static void idem_utf8_put(char *out, size_t *length, uint32_t point) {
    if (point < 0x80) {
        out[(*length)++] = (char)point;
    } else if (point < 0x800) {
        out[(*length)++] = (char)(0xC0 | (point >> 6));
        out[(*length)++] = (char)(0x80 | (point & 0x3F));
    } else if (point < 0x10000) {
        out[(*length)++] = (char)(0xE0 | (point >> 12));
        out[(*length)++] = (char)(0x80 | ((point >> 6) & 0x3F));
        out[(*length)++] = (char)(0x80 | (point & 0x3F));
    } else {
        out[(*length)++] = (char)(0xF0 | (point >> 18));
        out[(*length)++] = (char)(0x80 | ((point >> 12) & 0x3F));
        out[(*length)++] = (char)(0x80 | ((point >> 6) & 0x3F));
        out[(*length)++] = (char)(0x80 | (point & 0x3F));
    }
}

static bool idem_json_hex4(idem_json_reader *reader, uint32_t *value) {
    if (reader->end - reader->at < 4) return idem_json_fail(reader, "EOF while parsing a string");
    *value = 0;
    for (int index = 0; index < 4; index++) {
        unsigned char digit = *reader->at++;
        *value <<= 4;
        if (digit >= '0' && digit <= '9') *value |= (uint32_t)(digit - '0');
        else if (digit >= 'a' && digit <= 'f') *value |= (uint32_t)(digit - 'a' + 10);
        else if (digit >= 'A' && digit <= 'F') *value |= (uint32_t)(digit - 'A' + 10);
        else return idem_json_fail(reader, "invalid escape");
    }
    return true;
}

/* A string at the reader (after its opening quote), decoded into a new NUL-terminated text. */
static bool idem_json_string(idem_json_reader *reader, char **text, size_t *length) {
    /* Decoded text is never longer than its source, up to the closing quote. */
    const unsigned char *close = reader->at;
    while (close < reader->end && *close != '"') close += (*close == '\\') ? 2 : 1;
    if (close > reader->end) close = reader->end;
    char *out = (char *)malloc((size_t)(close - reader->at) + 1);
    if (out == NULL) return idem_json_fail(reader, "out of memory");
    size_t used = 0;
    for (;;) {
        if (reader->at >= reader->end) {
            free(out);
            return idem_json_fail(reader, "EOF while parsing a string");
        }
        unsigned char byte = *reader->at;
        if (byte == '"') {
            reader->at++;
            break;
        }
        if (byte < 0x20) {
            free(out);
            return idem_json_fail(reader, "control character (\\u0000-\\u001F) found while parsing a string");
        }
        if (byte != '\\') {
            size_t sequence = idem_utf8_length(reader->at, reader->end);
            if (sequence == 0) {
                free(out);
                return idem_json_fail(reader, "invalid unicode code point");
            }
            memcpy(out + used, reader->at, sequence);
            used += sequence;
            reader->at += sequence;
            continue;
        }
        reader->at++;
        if (reader->at >= reader->end) {
            free(out);
            return idem_json_fail(reader, "EOF while parsing a string");
        }
        unsigned char escape = *reader->at++;
        uint32_t point;
        switch (escape) {
        case '"': out[used++] = '"'; break;
        case '\\': out[used++] = '\\'; break;
        case '/': out[used++] = '/'; break;
        case 'b': out[used++] = '\b'; break;
        case 'f': out[used++] = '\f'; break;
        case 'n': out[used++] = '\n'; break;
        case 'r': out[used++] = '\r'; break;
        case 't': out[used++] = '\t'; break;
        case 'u':
            if (!idem_json_hex4(reader, &point)) {
                free(out);
                return false;
            }
            if (point >= 0xDC00 && point <= 0xDFFF) {
                free(out);
                return idem_json_fail(reader, "lone trailing surrogate in hex escape");
            }
            if (point >= 0xD800 && point <= 0xDBFF) {
                uint32_t low;
                if (reader->end - reader->at < 2 || reader->at[0] != '\\' || reader->at[1] != 'u') {
                    free(out);
                    return idem_json_fail(reader, "unexpected end of hex escape");
                }
                reader->at += 2;
                if (!idem_json_hex4(reader, &low)) {
                    free(out);
                    return false;
                }
                if (low < 0xDC00 || low > 0xDFFF) {
                    free(out);
                    return idem_json_fail(reader, "lone leading surrogate in hex escape");
                }
                point = 0x10000 + ((point - 0xD800) << 10) + (low - 0xDC00);
            }
            idem_utf8_put(out, &used, point);
            break;
        default:
            free(out);
            return idem_json_fail(reader, "invalid escape");
        }
    }
    out[used] = '\0';
    *text = out;
    *length = used;
    return true;
}

static bool idem_json_digits(idem_json_reader *reader) {
    const unsigned char *first = reader->at;
    while (reader->at < reader->end && *reader->at >= '0' && *reader->at <= '9') reader->at++;
    return reader->at > first;
}

/* A number at the reader, kept as its source text. */
static bool idem_json_number(idem_json_reader *reader, idem_json *value) {
    const unsigned char *first = reader->at;
    if (*reader->at == '-') reader->at++;
    if (reader->at < reader->end && *reader->at == '0') {
        reader->at++;
    } else if (!idem_json_digits(reader)) {
        return idem_json_fail(reader, "invalid number");
    }
    if (reader->at < reader->end && *reader->at == '.') {
        reader->at++;
        if (!idem_json_digits(reader)) return idem_json_fail(reader, "invalid number");
    }
    if (reader->at < reader->end && (*reader->at == 'e' || *reader->at == 'E')) {
        reader->at++;
        if (reader->at < reader->end && (*reader->at == '+' || *reader->at == '-')) reader->at++;
        if (!idem_json_digits(reader)) return idem_json_fail(reader, "invalid number");
    }
    value->kind = IDEM_NUMBER;
    value->length = (size_t)(reader->at - first);
    value->text = (char *)malloc(value->length + 1);
    if (value->text == NULL) return idem_json_fail(reader, "out of memory");
    memcpy(value->text, first, value->length);
    value->text[value->length] = '\0';
    return true;
}

static bool idem_json_literal(idem_json_reader *reader, const char *literal) {
    size_t length = strlen(literal);
    if ((size_t)(reader->end - reader->at) < length || memcmp(reader->at, literal, length) != 0) {
        return idem_json_fail(reader, "expected value");
    }
    reader->at += length;
    return true;
}

static bool idem_json_value(idem_json_reader *reader, idem_json *value, int depth);

/* An array or object at the reader (after its opening bracket): its items, and keys. */
static bool idem_json_members(idem_json_reader *reader, idem_json *value, int depth, bool object) {
    size_t capacity = 0;
    char close = object ? '}' : ']';
    value->kind = object ? IDEM_OBJECT : IDEM_ARRAY;
    if (depth >= IDEM_JSON_DEPTH) return idem_json_fail(reader, "recursion limit exceeded");
    idem_json_space(reader);
    if (reader->at < reader->end && *reader->at == close) {
        reader->at++;
        return true;
    }
    for (;;) {
        if (value->count == capacity) {
            capacity = capacity ? capacity * 2 : 4;
            idem_json *items = (idem_json *)realloc(value->items, capacity * sizeof(idem_json));
            if (items == NULL) return idem_json_fail(reader, "out of memory");
            value->items = items;
            if (object) {
                char **keys = (char **)realloc(value->keys, capacity * sizeof(char *));
                if (keys == NULL) return idem_json_fail(reader, "out of memory");
                value->keys = keys;
            }
        }
        idem_json *item = &value->items[value->count];
        memset(item, 0, sizeof *item);
        if (object) value->keys[value->count] = NULL;
        /* Counted at once, so a failure below frees what this member holds. */
        value->count++;
        if (object) {
            size_t key_length;
            idem_json_space(reader);
            if (reader->at >= reader->end) return idem_json_fail(reader, "EOF while parsing an object");
            if (*reader->at != '"') return idem_json_fail(reader, "key must be a string");
            reader->at++;
            if (!idem_json_string(reader, &value->keys[value->count - 1], &key_length)) return false;
            idem_json_space(reader);
            if (reader->at >= reader->end) return idem_json_fail(reader, "EOF while parsing an object");
            if (*reader->at != ':') return idem_json_fail(reader, "expected `:`");
            reader->at++;
        }
        if (!idem_json_value(reader, item, depth + 1)) return false;
        idem_json_space(reader);
        if (reader->at >= reader->end) {
            return idem_json_fail(reader, object ? "EOF while parsing an object" : "EOF while parsing a list");
        }
        if (*reader->at == ',') {
            reader->at++;
            continue;
        }
        if (*reader->at == close) {
            reader->at++;
            return true;
        }
        return idem_json_fail(reader, object ? "expected `,` or `}`" : "expected `,` or `]`");
    }
}

static bool idem_json_value(idem_json_reader *reader, idem_json *value, int depth) {
    idem_json_space(reader);
    if (reader->at >= reader->end) return idem_json_fail(reader, "EOF while parsing a value");
    switch (*reader->at) {
    case 'n':
        value->kind = IDEM_NULL;
        return idem_json_literal(reader, "null");
    case 't':
        value->kind = IDEM_BOOLEAN;
        value->boolean = true;
        return idem_json_literal(reader, "true");
    case 'f':
        value->kind = IDEM_BOOLEAN;
        return idem_json_literal(reader, "false");
    case '"':
        reader->at++;
        value->kind = IDEM_STRING;
        return idem_json_string(reader, &value->text, &value->length);
    case '[':
        reader->at++;
        return idem_json_members(reader, value, depth, false);
    case '{':
        reader->at++;
        return idem_json_members(reader, value, depth, true);
    default:
        if (*reader->at == '-' || (*reader->at >= '0' && *reader->at <= '9')) {
            return idem_json_number(reader, value);
        }
        return idem_json_fail(reader, "expected value");
    }
}

void idem_json_free(idem_json *value) {
    if (value == NULL) return;
    free(value->text);
    for (size_t index = 0; index < value->count; index++) {
        idem_json_free(&value->items[index]);
        if (value->keys != NULL) free(value->keys[index]);
    }
    free(value->items);
    free(value->keys);
    memset(value, 0, sizeof *value);
}

bool idem_json_parse(const uint8_t *text, size_t length, idem_json *value, const char **error, size_t *error_at) {
    idem_json_reader reader = {text, text + length, NULL, 0, text};
    memset(value, 0, sizeof *value);
    bool parsed = idem_json_value(&reader, value, 0);
    if (parsed) {
        idem_json_space(&reader);
        if (reader.at != reader.end) parsed = idem_json_fail(&reader, "trailing characters");
    }
    if (!parsed) {
        idem_json_free(value);
        *error = reader.error;
        *error_at = reader.error_at;
    }
    return parsed;
}

/* ---- Call-scoped memory ------------------------------------------------------------------ */

/* Text and events of the current call, released when the handler returns. */
static void **idem_scoped_items;
static bool *idem_scoped_is_event;
static size_t idem_scoped_count;
static size_t idem_scoped_capacity;
static idem_result idem_last_failure;

static void *idem_keep(void *item, bool is_event) {
    if (idem_scoped_count == idem_scoped_capacity) {
        size_t capacity = idem_scoped_capacity ? idem_scoped_capacity * 2 : 16;
        void **items = (void **)realloc(idem_scoped_items, capacity * sizeof(void *));
        bool *kinds = (bool *)realloc(idem_scoped_is_event, capacity * sizeof(bool));
        if (items == NULL || kinds == NULL) abort();
        idem_scoped_items = items;
        idem_scoped_is_event = kinds;
        idem_scoped_capacity = capacity;
    }
    idem_scoped_items[idem_scoped_count] = item;
    idem_scoped_is_event[idem_scoped_count] = is_event;
    idem_scoped_count++;
    return item;
}

static void idem_release(void) {
    for (size_t index = 0; index < idem_scoped_count; index++) {
        if (idem_scoped_is_event[index]) idem_json_free((idem_json *)idem_scoped_items[index]);
        free(idem_scoped_items[index]);
    }
    idem_scoped_count = 0;
}

static char *idem_vformat(const char *format, va_list arguments) {
    va_list measure;
    va_copy(measure, arguments);
    int length = vsnprintf(NULL, 0, format, measure);
    va_end(measure);
    if (length < 0) length = 0;
    char *text = (char *)malloc((size_t)length + 1);
    if (text == NULL) abort();
    vsnprintf(text, (size_t)length + 1, format, arguments);
    return text;
}

char *idem_format(const char *format, ...) {
    va_list arguments;
    va_start(arguments, format);
    char *text = idem_vformat(format, arguments);
    va_end(arguments);
    return (char *)idem_keep(text, false);
}

/* A contract string holding a copy of `length` bytes of `text` (the bindings free it). */
static plugin_string_t idem_string(const char *text, size_t length) {
    plugin_string_t string = {NULL, 0};
    if (length > 0) {
        string.ptr = (uint8_t *)malloc(length);
        if (string.ptr == NULL) abort();
        memcpy(string.ptr, text, length);
        string.len = length;
    }
    return string;
}

/* ---- JSON field access -------------------------------------------------------------------- */

static bool idem_fail_with(idem_plugin_types_failure_kind_t kind, char *reason) {
    idem_plugin_types_failure_free(&idem_last_failure.failure);
    idem_last_failure.ok = false;
    idem_last_failure.failure.kind = kind;
    idem_last_failure.failure.reason = idem_string(reason, strlen(reason));
    free(reason);
    return false;
}

static bool idem_invalid_field(const char *format, ...) IDEM_PRINTF(1, 2);
static bool idem_invalid_field(const char *format, ...) {
    va_list arguments;
    va_start(arguments, format);
    char *reason = idem_vformat(format, arguments);
    va_end(arguments);
    return idem_fail_with(IDEM_PLUGIN_TYPES_FAILURE_KIND_INVALID_INPUT, reason);
}

idem_result idem_failed(void) {
    idem_result failed = idem_last_failure;
    memset(&idem_last_failure, 0, sizeof idem_last_failure);
    if (failed.failure.reason.len == 0 && failed.failure.reason.ptr == NULL) {
        return idem_invalid("a field accessor failed without a reason");
    }
    return failed;
}

bool idem_parse_object(const idem_message *message, const idem_json **event) {
    idem_json *parsed = (idem_json *)malloc(sizeof(idem_json));
    const char *error = NULL;
    size_t error_at = 0;
    if (parsed == NULL) abort();
    if (!idem_json_parse(message->body.ptr, message->body.len, parsed, &error, &error_at)) {
        size_t line = 1, column = 1;
        for (size_t index = 0; index < error_at && index < message->body.len; index++) {
            if (message->body.ptr[index] == '\n') {
                line++;
                column = 1;
            } else {
                column++;
            }
        }
        free(parsed);
        return idem_invalid_field("body is not valid JSON: %s at line %zu column %zu", error, line, column);
    }
    idem_keep(parsed, true);
    if (parsed->kind != IDEM_OBJECT) {
        return idem_invalid_field("body must be a JSON object, got %s", idem_json_kind(parsed));
    }
    *event = parsed;
    return true;
}

const idem_json *idem_get(const idem_json *object, const char *name) {
    const idem_json *found = NULL;
    if (object == NULL || object->kind != IDEM_OBJECT) return NULL;
    for (size_t index = 0; index < object->count; index++) {
        if (strcmp(object->keys[index], name) == 0) found = &object->items[index];
    }
    return found;
}

const char *idem_json_kind(const idem_json *value) {
    switch (value == NULL ? IDEM_NULL : value->kind) {
    case IDEM_BOOLEAN: return "a boolean";
    case IDEM_NUMBER: return "a number";
    case IDEM_STRING: return "a string";
    case IDEM_ARRAY: return "an array";
    case IDEM_OBJECT: return "an object";
    default: return "null";
    }
}

/* Appends to a growing text. */
typedef struct {
    char *text;
    size_t length;
    size_t capacity;
} idem_buffer;

static void idem_append(idem_buffer *buffer, const char *text, size_t length) {
    if (buffer->length + length + 1 > buffer->capacity) {
        size_t capacity = buffer->capacity ? buffer->capacity : 32;
        while (capacity < buffer->length + length + 1) capacity *= 2;
        char *grown = (char *)realloc(buffer->text, capacity);
        if (grown == NULL) abort();
        buffer->text = grown;
        buffer->capacity = capacity;
    }
    memcpy(buffer->text + buffer->length, text, length);
    buffer->length += length;
    buffer->text[buffer->length] = '\0';
}

static void idem_render_string(idem_buffer *buffer, const char *text, size_t length) {
    idem_append(buffer, "\"", 1);
    for (size_t index = 0; index < length; index++) {
        unsigned char byte = (unsigned char)text[index];
        char escaped[8];
        switch (byte) {
        case '"': idem_append(buffer, "\\\"", 2); break;
        case '\\': idem_append(buffer, "\\\\", 2); break;
        case '\b': idem_append(buffer, "\\b", 2); break;
        case '\f': idem_append(buffer, "\\f", 2); break;
        case '\n': idem_append(buffer, "\\n", 2); break;
        case '\r': idem_append(buffer, "\\r", 2); break;
        case '\t': idem_append(buffer, "\\t", 2); break;
        default:
            if (byte < 0x20) {
                snprintf(escaped, sizeof escaped, "\\u%04x", byte);
                idem_append(buffer, escaped, 6);
            } else {
                idem_append(buffer, (const char *)&text[index], 1);
            }
        }
    }
    idem_append(buffer, "\"", 1);
}

static void idem_render_into(idem_buffer *buffer, const idem_json *value) {
    switch (value->kind) {
    case IDEM_NULL: idem_append(buffer, "null", 4); break;
    case IDEM_BOOLEAN: value->boolean ? idem_append(buffer, "true", 4) : idem_append(buffer, "false", 5); break;
    case IDEM_NUMBER: idem_append(buffer, value->text, value->length); break;
    case IDEM_STRING: idem_render_string(buffer, value->text, value->length); break;
    case IDEM_ARRAY:
    case IDEM_OBJECT:
        idem_append(buffer, value->kind == IDEM_ARRAY ? "[" : "{", 1);
        for (size_t index = 0; index < value->count; index++) {
            if (index > 0) idem_append(buffer, ",", 1);
            if (value->kind == IDEM_OBJECT) {
                idem_render_string(buffer, value->keys[index], strlen(value->keys[index]));
                idem_append(buffer, ":", 1);
            }
            idem_render_into(buffer, &value->items[index]);
        }
        idem_append(buffer, value->kind == IDEM_ARRAY ? "]" : "}", 1);
        break;
    }
}

char *idem_render(const idem_json *value) {
    idem_buffer buffer = {NULL, 0, 0};
    if (value == NULL) {
        idem_append(&buffer, "null", 4);
    } else {
        idem_render_into(&buffer, value);
    }
    return (char *)idem_keep(buffer.text, false);
}

/* The field, or NULL (with the failure kept) when it is missing or null. */
static const idem_json *idem_required(const idem_json *event, const char *name) {
    const idem_json *value = idem_get(event, name);
    if (value == NULL || value->kind == IDEM_NULL) {
        idem_invalid_field("missing field \"%s\"", name);
        return NULL;
    }
    return value;
}

static bool idem_wrong_type(const char *name, const char *expected, const idem_json *value) {
    return idem_invalid_field("field \"%s\" must be %s, got %s", name, expected, idem_json_kind(value));
}

/* The decimal integer `text` (an optional minus, digits, no leading zero) as an int64. */
static bool idem_parse_int64(const char *text, int64_t *out) {
    bool negative = text[0] == '-';
    const char *digit = text + (negative ? 1 : 0);
    uint64_t limit = negative ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    uint64_t magnitude = 0;
    if (*digit == '\0' || (digit[0] == '0' && digit[1] != '\0')) return false;
    for (; *digit != '\0'; digit++) {
        if (*digit < '0' || *digit > '9') return false;
        unsigned value = (unsigned)(*digit - '0');
        if (magnitude > (limit - value) / 10) return false;
        magnitude = magnitude * 10 + value;
    }
    *out = negative ? (int64_t)(0 - magnitude) : (int64_t)magnitude;
    return true;
}

bool idem_integer_field(const idem_json *event, const char *name, int64_t *out) {
    const idem_json *value = idem_required(event, name);
    if (value == NULL) return false;
    if (value->kind != IDEM_NUMBER) return idem_wrong_type(name, "an integer", value);
    if (!idem_parse_int64(value->text, out)) {
        return idem_invalid_field("field \"%s\" must be an integer between -2^63 and 2^63-1", name);
    }
    return true;
}

bool idem_optional_integer_field(const idem_json *event, const char *name, int64_t *out, bool *present) {
    const idem_json *value = idem_get(event, name);
    *present = value != NULL && value->kind != IDEM_NULL;
    return !*present || idem_integer_field(event, name, out);
}

bool idem_float_field(const idem_json *event, const char *name, double *out) {
    const idem_json *value = idem_required(event, name);
    if (value == NULL) return false;
    if (value->kind != IDEM_NUMBER) return idem_wrong_type(name, "a number", value);
    *out = strtod(value->text, NULL);
    return true;
}

bool idem_text_field(const idem_json *event, const char *name, const char **out) {
    const idem_json *value = idem_required(event, name);
    if (value == NULL) return false;
    if (value->kind != IDEM_STRING) return idem_wrong_type(name, "a string", value);
    *out = value->text;
    return true;
}

bool idem_optional_text_field(const idem_json *event, const char *name, const char **out, bool *present) {
    const idem_json *value = idem_get(event, name);
    *present = value != NULL && value->kind != IDEM_NULL;
    return !*present || idem_text_field(event, name, out);
}

bool idem_boolean_field(const idem_json *event, const char *name, bool *out) {
    const idem_json *value = idem_required(event, name);
    if (value == NULL) return false;
    if (value->kind != IDEM_BOOLEAN) return idem_wrong_type(name, "a boolean", value);
    *out = value->boolean;
    return true;
}

bool idem_object_field(const idem_json *event, const char *name, const idem_json **out) {
    const idem_json *value = idem_required(event, name);
    if (value == NULL) return false;
    if (value->kind != IDEM_OBJECT) return idem_wrong_type(name, "an object", value);
    *out = value;
    return true;
}

/* ---- The message -------------------------------------------------------------------------- */

static const char *idem_pair_value(const plugin_list_tuple2_string_string_t *pairs, const char *name, bool any_case) {
    size_t length = strlen(name);
    const plugin_tuple2_string_string_t *found = NULL;
    for (size_t index = 0; index < pairs->len; index++) {
        const plugin_string_t *key = &pairs->ptr[index].f0;
        if (key->len != length) continue;
        bool same = true;
        for (size_t at = 0; at < length && same; at++) {
            char left = (char)key->ptr[at], right = name[at];
            if (any_case) {
                if (left >= 'A' && left <= 'Z') left = (char)(left - 'A' + 'a');
                if (right >= 'A' && right <= 'Z') right = (char)(right - 'A' + 'a');
            }
            same = left == right;
        }
        if (same) {
            found = &pairs->ptr[index];
            break;
        }
    }
    if (found == NULL) return NULL;
    char *text = (char *)malloc(found->f1.len + 1);
    if (text == NULL) abort();
    if (found->f1.len > 0) memcpy(text, found->f1.ptr, found->f1.len);
    text[found->f1.len] = '\0';
    return (const char *)idem_keep(text, false);
}

const char *idem_header(const idem_message *message, const char *name) {
    return idem_pair_value(&message->headers, name, true);
}

const char *idem_attribute(const idem_message *message, const char *name) {
    return idem_pair_value(&message->attributes, name, false);
}

/* ---- Builders ----------------------------------------------------------------------------- */

idem_value idem_null(void) {
    idem_value value;
    memset(&value, 0, sizeof value);
    value.tag = IDEM_PLUGIN_TYPES_VALUE_NULL;
    return value;
}

idem_value idem_bool(bool flag) {
    idem_value value = idem_null();
    value.tag = IDEM_PLUGIN_TYPES_VALUE_BOOLEAN;
    value.val.boolean = flag;
    return value;
}

idem_value idem_int(int64_t integer) {
    idem_value value = idem_null();
    value.tag = IDEM_PLUGIN_TYPES_VALUE_INTEGER;
    value.val.integer = integer;
    return value;
}

idem_value idem_float(double number) {
    idem_value value = idem_null();
    value.tag = IDEM_PLUGIN_TYPES_VALUE_FLOAT;
    value.val.float_ = number;
    return value;
}

idem_value idem_text(const char *text) {
    idem_value value = idem_null();
    value.tag = IDEM_PLUGIN_TYPES_VALUE_TEXT;
    value.val.text = idem_string(text, strlen(text));
    return value;
}

idem_value idem_json_text(const char *json) {
    idem_value value = idem_null();
    value.tag = IDEM_PLUGIN_TYPES_VALUE_JSON;
    value.val.json = idem_string(json, strlen(json));
    return value;
}

idem_value idem_bytes(const uint8_t *bytes, size_t length) {
    idem_value value = idem_null();
    plugin_string_t copy = idem_string((const char *)bytes, length);
    value.tag = IDEM_PLUGIN_TYPES_VALUE_BYTES;
    value.val.bytes.ptr = copy.ptr;
    value.val.bytes.len = copy.len;
    return value;
}

idem_value idem_timestamp(int64_t micros) {
    idem_value value = idem_null();
    value.tag = IDEM_PLUGIN_TYPES_VALUE_TIMESTAMP;
    value.val.timestamp = micros;
    return value;
}

/* A copy of `count` items of `size` bytes (NULL for none): the list the bindings free. */
static void *idem_list(const void *items, size_t count, size_t size) {
    if (count == 0) return NULL;
    void *list = malloc(count * size);
    if (list == NULL) abort();
    memcpy(list, items, count * size);
    return list;
}

idem_effect idem_exec_n(const char *statement, const idem_value *params, size_t count) {
    idem_effect effect;
    memset(&effect, 0, sizeof effect);
    effect.tag = IDEM_PLUGIN_TYPES_EFFECT_EXEC;
    effect.val.exec.statement = idem_string(statement, strlen(statement));
    effect.val.exec.params.ptr = (idem_value *)idem_list(params, count, sizeof(idem_value));
    effect.val.exec.params.len = count;
    return effect;
}

idem_effect idem_outbox(const char *destination, const uint8_t *payload, size_t length, const char *key) {
    idem_effect effect;
    plugin_string_t copy = idem_string((const char *)payload, length);
    memset(&effect, 0, sizeof effect);
    effect.tag = IDEM_PLUGIN_TYPES_EFFECT_OUTBOX;
    effect.val.outbox.destination = idem_string(destination, strlen(destination));
    effect.val.outbox.payload.ptr = copy.ptr;
    effect.val.outbox.payload.len = copy.len;
    effect.val.outbox.key.is_some = key != NULL;
    if (key != NULL) effect.val.outbox.key.val = idem_string(key, strlen(key));
    return effect;
}

idem_result idem_decision_n(const char *key, const idem_effect *effects, size_t count) {
    idem_result result;
    memset(&result, 0, sizeof result);
    result.ok = true;
    result.outcome.tag = IDEM_PLUGIN_TYPES_OUTCOME_DECISION;
    result.outcome.val.decision.key = idem_string(key, strlen(key));
    result.outcome.val.decision.effects.ptr = (idem_effect *)idem_list(effects, count, sizeof(idem_effect));
    result.outcome.val.decision.effects.len = count;
    return result;
}

idem_result idem_skip(const char *format, ...) {
    idem_result result;
    va_list arguments;
    memset(&result, 0, sizeof result);
    va_start(arguments, format);
    char *reason = idem_vformat(format, arguments);
    va_end(arguments);
    result.ok = true;
    result.outcome.tag = IDEM_PLUGIN_TYPES_OUTCOME_SKIP;
    result.outcome.val.skip = idem_string(reason, strlen(reason));
    free(reason);
    return result;
}

static idem_result idem_failure_result(idem_plugin_types_failure_kind_t kind, const char *format, va_list arguments) {
    idem_result result;
    memset(&result, 0, sizeof result);
    char *reason = idem_vformat(format, arguments);
    result.failure.kind = kind;
    result.failure.reason = idem_string(reason, strlen(reason));
    free(reason);
    return result;
}

idem_result idem_invalid(const char *format, ...) {
    va_list arguments;
    va_start(arguments, format);
    idem_result result = idem_failure_result(IDEM_PLUGIN_TYPES_FAILURE_KIND_INVALID_INPUT, format, arguments);
    va_end(arguments);
    return result;
}

idem_result idem_retryable(const char *format, ...) {
    va_list arguments;
    va_start(arguments, format);
    idem_result result = idem_failure_result(IDEM_PLUGIN_TYPES_FAILURE_KIND_RETRYABLE, format, arguments);
    va_end(arguments);
    return result;
}

void idem_log(idem_plugin_log_level_t level, const char *format, ...) {
    va_list arguments;
    va_start(arguments, format);
    char *line = idem_vformat(format, arguments);
    va_end(arguments);
    plugin_string_t message = {(uint8_t *)line, strlen(line)};
    idem_plugin_log_log(level, &message);
    free(line);
}

/* ---- The export --------------------------------------------------------------------------- */

bool exports_idem_plugin_handler_handle(exports_idem_plugin_handler_message_t *message,
                                        exports_idem_plugin_handler_outcome_t *ret,
                                        exports_idem_plugin_handler_failure_t *err) {
    idem_result result = idem_handle(message);
    idem_release();
    idem_plugin_types_failure_free(&idem_last_failure.failure);
    memset(&idem_last_failure, 0, sizeof idem_last_failure);
    exports_idem_plugin_handler_message_free(message);
    if (result.ok) {
        *ret = result.outcome;
    } else {
        *err = result.failure;
    }
    return result.ok;
}

#ifdef __cplusplus
}
#endif
#endif /* IDEM_IMPLEMENTATION */

#endif /* IDEM_H */
