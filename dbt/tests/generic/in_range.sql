-- Rows whose value lies outside [min_value, max_value] (nulls are not_null's business).
-- Used for shares, which are fractions of wall time: 0..1.
{% test in_range(model, column_name, min_value, max_value) %}
select {{ column_name }} as out_of_range_value
from {{ model }}
where {{ column_name }} < {{ min_value }} or {{ column_name }} > {{ max_value }}
{% endtest %}
